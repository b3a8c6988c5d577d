"""What the baseline drafters of :mod:`lab.baselines` train from: the vLLM aux layer
ids each method reads (:func:`default_layer_ids`, :func:`file_layer_ids`, and the union kept in a
shared store, :func:`store_layer_ids`), the training rows (:func:`load_sequences`: DLite's
regenerated sequences with a response loss mask) and the shared feature store
(:func:`write_feature_store`: one ``hs_{i}.safetensors`` per sequence holding every layer a method
may read, the speculators ``datasets`` table and ``dlite_features.json``; resumable, refuses a
store built from other sequences or layers). Needs the HF target and ``datasets``, not
speculators.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

PathLike = Union[str, Path]

METHODS = ("eagle3", "dflash", "dspark")
FEATURES_META = "dlite_features.json"


# =========================================================================== layer ids
def evenly_spaced_aux_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` vLLM aux ids among ``1..N``: ``round(linspace(1, N, count))`` on exact fractions
    (Python's round, half to even), de-duplicated; ``count == 1`` gives ``[N]``."""
    from fractions import Fraction

    if count == 1:
        return [num_target_layers]
    step = Fraction(num_target_layers - 1, count - 1)
    return sorted({round(1 + i * step) for i in range(count)})


def default_layer_ids(method: str, num_target_layers: int) -> list[int]:
    """Default vLLM aux ids for ``method`` on an N-layer target (see the docstring of
    :mod:`lab.baselines`)."""
    n = num_target_layers
    if method == "eagle3":
        ids = sorted({2, n // 2, n - 1}) if n >= 6 else evenly_spaced_aux_ids(n, min(3, n))
        return ids
    if method in ("dflash", "dspark"):
        return evenly_spaced_aux_ids(n, min(6, n))
    raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")


def file_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """What speculators reads from a hidden-state file: the aux ids then id N (last hidden)."""
    return [int(i) for i in layer_ids] + [int(num_target_layers)]


def store_layer_ids(num_target_layers: int, extra: Sequence[Sequence[int]] = ()) -> list[int]:
    """Layers kept in the shared feature store: ids ``1..N`` (so any selection, DLite's "all
    layers" included, trains from one store), every method's defaults and ``extra``."""
    ids = set(range(1, num_target_layers + 1))
    for method in METHODS:
        ids.update(default_layer_ids(method, num_target_layers))
    for group in extra:
        ids.update(int(i) for i in group)
    return sorted(ids)


# =========================================================================== 1. sequences
@dataclass
class Sequences:
    """Training rows: ``index[r]`` is the :class:`~vllm_dlite.train.sequences.SequenceStore`
    index of row ``r`` (its feature file is ``hs_{index[r]}``, the naming DLite's own feature
    files use too)."""

    index: list[int]
    input_ids: list[list[int]]
    loss_mask: list[list[int]]

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.input_ids)

    def select(self, rows: Sequence[int]) -> "Sequences":
        return Sequences([self.index[r] for r in rows], [self.input_ids[r] for r in rows],
                         [self.loss_mask[r] for r in rows])


def load_sequences(data: PathLike, max_len: Optional[int] = None) -> Sequences:
    """Training rows from a regenerated JSONL (or a directory holding exactly one).

    Same sequences as DLite's trainer: :class:`~vllm_dlite.train.sequences.SequenceStore`
    (longer sequences keep their last ``max_len`` tokens) and every sequence with at least one
    anchor. ``loss_mask[p] = 1`` on the response tokens (``p >= prompt_len``).
    """
    from vllm_dlite.train.sequences import SequenceStore

    path = Path(data)
    if path.is_dir():
        found = sorted(path.glob("*.jsonl"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"{path} should hold exactly one regenerated *.jsonl (found {len(found)}); pass "
                "the file itself as --data"
            )
        path = found[0]
    store = SequenceStore.open(path, max_len=max_len)
    rows = Sequences([], [], [])
    for i in range(len(store)):
        if store.num_anchors(i) <= 0:
            continue
        ids = store.token_ids(i).astype("int64").tolist()
        start = store.response_start(i)
        rows.index.append(i)
        rows.input_ids.append(ids)
        rows.loss_mask.append([0] * start + [1] * (len(ids) - start))
    if not len(rows):
        raise ValueError(f"{path}: no sequence with a response of >= 2 tokens")
    return rows


# =========================================================================== 2. features
def write_feature_store(
    target: PathLike,
    sequences: Sequences,
    out_dir: PathLike,
    layer_ids: Sequence[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    reuse: Optional[PathLike] = None,
    source: str = "",
    progress: bool = True,
) -> Path:
    """Write (or complete) a speculators-format feature store for ``sequences``.

    * ``out_dir/hidden_states/hs_{i}.safetensors`` for store index ``i`` (``hidden_states
      [T, L, H]`` in ``dtype``, the aux ids ``layer_ids`` in the metadata, ``token_ids [T]``),
      written by :func:`vllm_dlite.train.features.write_hs_file` from the HF target. With
      ``reuse`` (a directory of such files indexed the same way, e.g. DLite's
      ``runs/dlite-.../data/features/hidden_states``), files found there are read instead and
      only the missing ones are computed.
    * the ``datasets`` table (``input_ids``, ``loss_mask``, ``seq_len``, torch format, the layout
      of ``speculators prepare-data``), rows in ``sequences`` order;
    * ``dlite_features.json``: layer ids, ``file_index`` (row -> store index), ``reuse``.

    A store built from other sequences or layers is refused.
    """
    from datasets import Dataset

    from vllm_dlite.train.features import (
        HS_DIRNAME,
        TargetFeatureExtractor,
        hs_file_path,
        read_hs_file,
        write_hs_file,
    )

    out_dir = Path(out_dir)
    layer_ids = [int(i) for i in layer_ids]
    fingerprint = _sequences_fingerprint(sequences)
    meta = dict(target=str(target), layer_ids=layer_ids, dtype=str(dtype).removeprefix("torch."),
                num_sequences=len(sequences), num_tokens=sequences.num_tokens,
                fingerprint=fingerprint, source=source,
                reuse=str(Path(reuse).resolve()) if reuse else None,
                file_index=list(sequences.index))
    meta_path = out_dir / FEATURES_META
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old.get("fingerprint") != fingerprint or old.get("layer_ids") != layer_ids:
            raise ValueError(
                f"{out_dir} holds features of other sequences or layers ({old.get('num_sequences')}"
                f" sequences, layers {old.get('layer_ids')}); use another --features dir or "
                "delete it"
            )
        if old == meta and (out_dir / "state.json").is_file():
            return out_dir  # complete (e.g. written by another method's run)
    hs_dir = out_dir / HS_DIRNAME
    hs_dir.mkdir(parents=True, exist_ok=True)
    if reuse:
        probe = next((hs_file_path(reuse, i) for i in sequences.index
                      if hs_file_path(reuse, i).exists()), None)
        if probe is not None:
            read_hs_file(probe, layer_ids=layer_ids)  # raises if the reused files lack a layer
    todo = [r for r, i in enumerate(sequences.index)
            if not hs_file_path(hs_dir, i).exists()
            and not (reuse and hs_file_path(reuse, i).exists())]
    if todo:
        extractor = TargetFeatureExtractor.from_pretrained(target, layer_ids)
        t0, done_tokens = time.time(), 0
        for n, r in enumerate(todo, 1):
            ids = sequences.input_ids[r]
            out = extractor(torch.tensor(ids, dtype=torch.long))
            write_hs_file(hs_file_path(hs_dir, sequences.index[r]), ids,
                          out.features[0].to(dtype), layer_ids)
            done_tokens += len(ids)
            if progress and (n % 50 == 0 or n == len(todo)):
                rate = done_tokens / max(time.time() - t0, 1e-6)
                print(f"[features] {n}/{len(todo)} sequences, {done_tokens} tokens "
                      f"({rate:.0f} tok/s)", flush=True)
        del extractor
    table = Dataset.from_dict({
        "input_ids": sequences.input_ids,
        "loss_mask": sequences.loss_mask,
        "seq_len": [len(s) for s in sequences.input_ids],
    })
    table.set_format(type="torch")
    tmp = out_dir / ".table.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    table.save_to_disk(str(tmp))
    for item in tmp.iterdir():  # the table lives at the top of out_dir (speculators' layout)
        item.replace(out_dir / item.name)
    tmp.rmdir()
    meta_path.write_text(json.dumps(meta) + "\n")
    return out_dir


def _sequences_fingerprint(sequences: Sequences) -> str:
    import hashlib

    h = hashlib.sha256()
    for i, ids, mask in zip(sequences.index, sequences.input_ids, sequences.loss_mask):
        h.update(str(i).encode())
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        h.update(bytes(int(m) for m in mask))
    return h.hexdigest()[:16]


def read_store_meta(features_dir: PathLike) -> dict:
    meta_path = Path(features_dir) / FEATURES_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{features_dir} is not a feature store (no {FEATURES_META})")
    return json.loads(meta_path.read_text())


def read_store_layer_ids(features_dir: PathLike) -> list[int]:
    return list(read_store_meta(features_dir)["layer_ids"])


__all__ = [
    "FEATURES_META",
    "METHODS",
    "Sequences",
    "default_layer_ids",
    "evenly_spaced_aux_ids",
    "file_layer_ids",
    "load_sequences",
    "read_store_layer_ids",
    "read_store_meta",
    "store_layer_ids",
    "write_feature_store",
]
