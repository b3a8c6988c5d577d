"""DLite training data as the trainer reads it: the regenerated sequences of
:mod:`vllm_dlite.train.data` (a JSONL of ``token_ids`` + ``prompt_len`` records, also written by
:func:`write_sequences_jsonl`) stored for every rank, their anchors sampled and the sequences
packed into per-rank batches (:class:`SequenceBatch`: padded tokens, anchors, labels, groups).
Every choice is a pure function of ``(seed, stage, epoch, sequence)`` and the rank count, so a
resumed or re-batched run sees the same anchors.

2. **Storage** (:class:`SequenceStore`): the JSONL is converted once into a flat int32 token array
   + index (memory-mapped ``.npy`` files next to it), so large corpora do not live in Python lists
   on every rank.

3. **Anchors** (the authors' rule, ``docs/dlite_v1.md`` §6): for a sequence ``x_0..x_{S-1}``
   whose response (``loss_mask``) starts at ``P``, the anchors are the positions ``a`` in
   ``[1, S-B]`` with ``loss_mask[a]`` and ``loss_mask[a+1]`` set, i.e. ``a`` in
   ``[max(P, 1, G-1), S-B]`` (``G-1``: the anchor group ``x_{a-G+1..a}`` exists; a no-op for
   G <= 2). The whole block ``x_a..x_{a+B-1}`` lies inside the sequence, so all K = B-1 labels
   ``x_{a+1..a+K}`` are valid; the draft input is the feature row ``a - 1`` plus the group.
   :func:`sample_anchor_positions` draws up to ``anchors_per_seq`` (authors: 512) uniformly
   without replacement (all when 0/None) from a generator seeded by ``(seed, stage, epoch,
   sequence)`` only, so sampling does not depend on batching, rank count or resumption.

4. **Batches** (:func:`plan_batches`, :func:`collate`): per epoch a deterministic, length-bucketed
   shuffle packs sequences into batches under a token budget (padded tokens), the batches are
   shuffled and dealt round-robin to ranks (every rank gets the same number of batches).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

PathLike = Union[str, Path]


# =========================================================================== 2. storage
class SequenceStore:
    """Token sequences with their response start, memory-mapped from a regenerated JSONL.

    ``token_ids(i) -> np.ndarray[int32] [T_i]``, ``response_start(i)``, ``length(i)``,
    ``ids[i]``, ``kinds[i]``. Built once into ``<jsonl>.tokens.npy`` / ``.index.npy`` /
    ``.records.json`` (rebuilt when the JSONL is newer). Sequences longer than ``max_len`` keep
    their LAST ``max_len`` tokens (response start shifted accordingly).
    """

    def __init__(self, tokens: np.ndarray, index: np.ndarray, ids: list[str], kinds: list[str]):
        self.tokens = tokens  # [sum T] int32
        self.index = index  # [n, 3] int64: offset, length, response_start
        self.ids = ids
        self.kinds = kinds

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def length(self, i: int) -> int:
        return int(self.index[i, 1])

    def response_start(self, i: int) -> int:
        return int(self.index[i, 2])

    def token_ids(self, i: int) -> np.ndarray:
        off, n, _ = self.index[i]
        return np.asarray(self.tokens[off : off + n])

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.index[:, 1])

    def num_anchors(self, i: int, block_size: int = 2, group_size: int = 1) -> int:
        """Anchor positions available in sequence i (the rule of :func:`anchor_range`; the
        default ``block_size=2`` counts every response position with a next token)."""
        lo, hi = anchor_range(self.length(i), self.response_start(i), block_size, group_size)
        return max(0, hi - lo + 1)

    def fingerprint(self) -> str:
        """Content fingerprint (index + token count + first/last MiB of tokens): identifies the
        sequences that derived files (e.g. feature files keyed by sequence index) were built on."""
        h = hashlib.sha256(np.ascontiguousarray(self.index).tobytes())
        tokens = self.tokens
        h.update(str(tokens.shape[0]).encode())
        h.update(np.ascontiguousarray(tokens[: 1 << 18]).tobytes())
        h.update(np.ascontiguousarray(tokens[-(1 << 18):]).tobytes())
        return h.hexdigest()[:16]

    @staticmethod
    def cache_paths(jsonl: PathLike) -> tuple[Path, Path, Path]:
        p = str(jsonl)
        return Path(p + ".tokens.npy"), Path(p + ".index.npy"), Path(p + ".records.json")

    @classmethod
    def build_cache(cls, jsonl: PathLike, max_len: Optional[int] = None) -> None:
        """Convert the JSONL into the memory-map files (atomic renames)."""
        tokens_path, index_path, records_path = cls.cache_paths(jsonl)
        chunks, index, ids, kinds, offset = [], [], [], [], 0
        with open(jsonl, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    toks, start = rec["token_ids"], int(rec["prompt_len"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise ValueError(
                        f"{jsonl}:{lineno}: not a regenerated-sequence record ({exc}); records "
                        "need token_ids and prompt_len (see vllm_dlite.train.data)"
                    ) from None
                if max_len is not None and len(toks) > max_len:
                    cut = len(toks) - max_len
                    toks, start = toks[cut:], max(0, start - cut)
                chunks.append(np.asarray(toks, dtype=np.int32))
                index.append((offset, len(toks), start))
                ids.append(str(rec.get("id", lineno)))
                kinds.append(str(rec.get("kind", "")))
                offset += len(toks)
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        for path, arr in ((tokens_path, tokens), (index_path, np.asarray(index, dtype=np.int64))):
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, arr.reshape(-1, 3) if arr.dtype == np.int64 else arr)
            tmp.replace(path)
        tmp = records_path.with_name(records_path.name + ".tmp")
        tmp.write_text(json.dumps({"ids": ids, "kinds": kinds, "max_len": max_len}))
        tmp.replace(records_path)

    @classmethod
    def cache_is_fresh(cls, jsonl: PathLike, max_len: Optional[int] = None) -> bool:
        paths = cls.cache_paths(jsonl)
        if not all(p.is_file() for p in paths):
            return False
        if min(p.stat().st_mtime for p in paths) < Path(jsonl).stat().st_mtime:
            return False
        try:
            return json.loads(paths[2].read_text()).get("max_len") == max_len
        except json.JSONDecodeError:
            return False

    @classmethod
    def open(cls, jsonl: PathLike, max_len: Optional[int] = None, build: bool = True
             ) -> "SequenceStore":
        """Memory-map the cache (building it first when ``build`` and it is stale)."""
        if not Path(jsonl).is_file():
            raise FileNotFoundError(
                f"sequence file {jsonl} not found: regenerate it with "
                "`python -m vllm_dlite.train.data --target MODEL --out FILE` or let the trainer "
                "do it (data.sequences unset)"
            )
        if not cls.cache_is_fresh(jsonl, max_len):
            if not build:
                raise RuntimeError(f"the memory-map cache of {jsonl} is missing or stale")
            cls.build_cache(jsonl, max_len)
        tokens_path, index_path, records_path = cls.cache_paths(jsonl)
        records = json.loads(records_path.read_text())
        return cls(
            np.load(tokens_path, mmap_mode="r"),
            np.load(index_path),
            records["ids"],
            records["kinds"],
        )

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Sequence[int]], response_starts: Sequence[int],
        kinds: Optional[Sequence[str]] = None,
    ) -> "SequenceStore":
        """In-memory store (tests, small tools)."""
        lengths = [len(s) for s in sequences]
        offsets = np.cumsum([0] + lengths[:-1])
        index = np.stack([offsets, lengths, np.asarray(response_starts)], axis=1).astype(np.int64)
        tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences])
        return cls(tokens, index, [str(i) for i in range(len(sequences))],
                   list(kinds) if kinds else [""] * len(sequences))


# =========================================================================== 3. anchors
def _generator(*key: Any) -> np.random.Generator:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def anchor_range(length: int, response_start: int, block_size: int, group_size: int = 1
                 ) -> tuple[int, int]:
    """``(lo, hi)`` inclusive: anchors ``a`` in ``[1, S-B]`` with ``loss_mask[a]`` and
    ``loss_mask[a+1]`` (the response starts at ``response_start``) and ``a >= G-1``."""
    return max(response_start, 1, group_size - 1), length - block_size


def sample_anchor_positions(
    length: int, response_start: int, anchors_per_seq: Optional[int], key: tuple,
    block_size: int, group_size: int = 1,
) -> np.ndarray:
    """Sorted anchor positions (int64) of one sequence (see :func:`anchor_range`).

    All of them when ``anchors_per_seq`` is falsy or not smaller than the count; otherwise a
    uniform sample without replacement drawn from a generator keyed by ``key`` (e.g.
    ``(seed, stage, epoch, sequence index)``).
    """
    lo, hi = anchor_range(length, response_start, block_size, group_size)
    if hi < lo:
        return np.zeros(0, dtype=np.int64)
    positions = np.arange(lo, hi + 1, dtype=np.int64)
    if anchors_per_seq and anchors_per_seq < len(positions):
        positions = np.sort(_generator(*key).choice(positions, anchors_per_seq, replace=False))
    return positions


# =========================================================================== 4. batches
def plan_batches(
    lengths: np.ndarray,
    *,
    max_tokens_per_batch: int,
    max_seqs_per_batch: int,
    seed: int,
    key: tuple,
    rank: int = 0,
    world_size: int = 1,
    bucket_factor: int = 32,
) -> list[list[int]]:
    """This rank's batches (lists of sequence indices) for one epoch.

    Deterministic in ``(seed, key)``: shuffle, sort mega-chunks of ``bucket_factor`` batches' worth
    by length (less padding), cut batches under the budget ``max_seqs * max_len_in_batch <=
    max_tokens_per_batch`` (a longer sequence alone always forms a batch), shuffle the batches,
    deal them round-robin to ranks and drop the remainder so every rank gets the same count.
    """
    rng = _generator(seed, "plan", *key)
    order = rng.permutation(len(lengths))
    mega = max(1, bucket_factor * max_seqs_per_batch)
    batches: list[list[int]] = []
    for start in range(0, len(order), mega):
        chunk = sorted(order[start : start + mega].tolist(), key=lambda i: int(lengths[i]))
        current: list[int] = []
        longest = 0
        for i in chunk:
            n = int(lengths[i])
            new_longest = max(longest, n)
            if current and (
                len(current) + 1 > max_seqs_per_batch
                or new_longest * (len(current) + 1) > max_tokens_per_batch
            ):
                batches.append(current)
                current, new_longest = [], n
            current.append(i)
            longest = new_longest
        if current:
            batches.append(current)
    perm = rng.permutation(len(batches))
    batches = [batches[i] for i in perm]
    per_rank = len(batches) // world_size
    return batches[rank : per_rank * world_size : world_size]


@dataclass
class SequenceBatch:
    """One micro-batch: S sequences (right-padded) and their N anchors.

    input_ids ``[S, T]`` int64 (padding = 0), attention_mask ``[S, T]`` bool, lengths ``[S]``,
    seq_index ``[N]``, anchor_pos ``[N]`` (a), anchor_ids ``[N]`` (x_a), group_ids ``[N, G]``
    (``x_{a-G+1..a}``, anchor last), labels ``[N, K]`` (``x_{a+1..a+K}``, 0 where invalid),
    label_mask ``[N, K]`` bool (all True under the authors' anchor rule), seq_numbers ``[S]``
    (store indices), kinds (per sequence).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    seq_index: torch.Tensor
    anchor_pos: torch.Tensor
    anchor_ids: torch.Tensor
    group_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    seq_numbers: list[int]
    kinds: list[str]

    @property
    def num_anchors(self) -> int:
        return int(self.anchor_pos.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: Union[str, torch.device]) -> "SequenceBatch":
        moved = {
            f.name: getattr(self, f.name).to(device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        return SequenceBatch(**moved)

    def block_positions(self) -> torch.Tensor:
        """``[N, K]`` positions ``a + k`` (k = 0..K-1) whose target distribution predicted the
        label ``x_{a+k+1}``, clamped into the sequence (use ``label_mask`` for validity)."""
        K = self.labels.shape[1]
        pos = self.anchor_pos[:, None] + torch.arange(K, device=self.anchor_pos.device)
        return pos.clamp(max=self.input_ids.shape[1] - 1)


def collate(
    store: SequenceStore,
    seq_numbers: Sequence[int],
    *,
    block_size: int,
    anchors_per_seq: Optional[int],
    key: tuple,
    group_size: int = 1,
) -> SequenceBatch:
    """Build a :class:`SequenceBatch` (``block_size`` = B, counting the anchor: K = B-1 labels);
    anchors of sequence ``s`` use key ``key + (s,)``."""
    S = len(seq_numbers)
    T = max(store.length(s) for s in seq_numbers)
    input_ids = torch.zeros(S, T, dtype=torch.long)
    attention_mask = torch.zeros(S, T, dtype=torch.bool)
    lengths = torch.zeros(S, dtype=torch.long)
    seq_index, anchor_pos = [], []
    for row, s in enumerate(seq_numbers):
        toks = torch.from_numpy(store.token_ids(s).astype(np.int64))
        n = toks.shape[0]
        input_ids[row, :n] = toks
        attention_mask[row, :n] = True
        lengths[row] = n
        pos = sample_anchor_positions(n, store.response_start(s), anchors_per_seq, key + (s,),
                                      block_size, group_size)
        anchor_pos.append(torch.from_numpy(pos))
        seq_index.append(torch.full((len(pos),), row, dtype=torch.long))
    seq_index_t = torch.cat(seq_index) if seq_index else torch.zeros(0, dtype=torch.long)
    anchor_pos_t = torch.cat(anchor_pos) if anchor_pos else torch.zeros(0, dtype=torch.long)
    K = block_size - 1
    label_pos = anchor_pos_t[:, None] + 1 + torch.arange(K)  # [N, K]
    label_mask = label_pos < lengths[seq_index_t][:, None]
    labels = input_ids[seq_index_t[:, None], label_pos.clamp(max=T - 1)]
    labels = torch.where(label_mask, labels, 0)
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        lengths=lengths,
        seq_index=seq_index_t,
        anchor_pos=anchor_pos_t,
        anchor_ids=input_ids[seq_index_t, anchor_pos_t],
        group_ids=input_ids[seq_index_t[:, None],
                            (anchor_pos_t[:, None] - group_size + 1 + torch.arange(group_size)).clamp_min(0)],
        labels=labels,
        label_mask=label_mask,
        seq_numbers=list(seq_numbers),
        kinds=[store.kinds[s] for s in seq_numbers],
    )


def write_sequences_jsonl(path: PathLike, records: Iterable[dict]) -> int:
    """Write sequence records (``token_ids``, ``prompt_len``, optional ``id``/``kind``)."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n


__all__ = [
    "SequenceBatch",
    "SequenceStore",
    "anchor_range",
    "collate",
    "plan_batches",
    "sample_anchor_positions",
    "write_sequences_jsonl",
]
