"""Baseline drafters for the A/B benchmark: EAGLE-3, DFlash and DSpark trained with
``speculators==0.9.0`` (vLLM's drafter-training library), on CPU or GPU, from the SAME
target-regenerated data as DLite.

Pipeline (``python -m vllm_dlite.train.baselines --method eagle3|dflash|dspark ...``):

1. **Sequences**: the regenerated JSONL of :mod:`vllm_dlite.train.data` (prompt + the target's own
   greedy answer), read through :class:`~vllm_dlite.train.sequences.SequenceStore` exactly as DLite's
   trainer reads it (sequences longer than ``--max-len`` keep their LAST tokens; sequences with
   at least one anchor). Each becomes one speculators row ``(input_ids, loss_mask)`` with
   ``loss_mask = 1`` on the response tokens; rows get a fixed shuffle (speculators validates on
   the table's tail, ``--train-data-ratio`` 0.98).
2. **Features** (one shared store for every method): the frozen HF target
   (:class:`~vllm_dlite.train.features.TargetFeatureExtractor`, vLLM's aux-id convention) writes
   ``hs_{i}.safetensors`` for sequence ``i`` of the store with
   :func:`~vllm_dlite.train.features.write_hs_file`, holding every layer a method may read
   (default ids ``1..N``, bfloat16: 6 KB per token for the 12-layer target), plus the
   speculators ``datasets`` table. vLLM's extraction connector is CUDA-only, hence HF. The store
   is written once and resumable; ``--reuse-features`` reads DLite's own feature files (same
   naming) instead of recomputing them.
3. **Training**: speculators' own trainer (``speculators.train.cli.main``) runs in-process; on a
   machine without an accelerator with the CPU-safe settings (``--draft-attn-impl sdpa --loss-implementation eager --num-workers 0
   --hidden-states-dtype float32``) and :func:`cpu_safe_speculators`, which patches the few
   accelerator-only calls of its trainer at runtime (nothing in site-packages is edited). Each
   method reads its own layers out of the shared store through the hidden-states backend
   ``dlite_layers`` registered here (speculators' backend plugin interface).
4. **Export**: the last epoch's checkpoint is copied to ``--out`` (``config.json`` +
   ``model.safetensors``, bf16) WITHOUT the frozen copies of the target's ``embed_tokens`` /
   ``lm_head`` (vLLM then shares the target's, exactly what it does for DLite), plus a README.
   ``LLM(target, speculative_config={"method": "eagle3"|"dflash", "model": out,
   "num_speculative_tokens": 7})`` loads it unchanged.

Layer ids (all in vLLM's aux-id convention, docs/design.md §2: id ``i`` = residual stream after
``i`` decoder layers, pre-norm; 0 = embeddings, N = after the last layer, before the final norm):

* speculators' ``--target-layer-ids`` ARE vLLM aux ids: EAGLE-3 stores them as
  ``eagle_aux_hidden_state_layer_ids`` (vLLM uses them as-is), DFlash/DSpark as
  ``aux_hidden_state_layer_ids`` (vLLM's speculators adapter passes them as-is to the model runner
  and as ``i - 1`` to ``dflash_config.target_layer_ids``, DFlash's "output of layer i" convention).
* speculators reads a hidden-state file as ``[aux layers..., id N]``: the last entry is the
  verifier's pre-norm last hidden state (teacher logits = ``lm_head(norm(h_N))``). The backend
  below always appends id N, so N may also be an aux id (DFlash uses it, as DLite does).
* Defaults for an N-layer target: EAGLE-3 ``[2, N//2, N-1]`` (low/mid/high, N=12: ``[2, 6, 11]``);
  DFlash/DSpark: six evenly spaced aux ids ``round(linspace(1, N, 6))`` (N=12: ``[1, 3, 5, 8, 10, 12]``;
  the shipped baselines were trained with these).

Sizes (fair-comparison rule, docs/design.md §8): EAGLE-3 one decoder layer, DFlash/DSpark
``--num-layers 2`` (DLite's depth), width = target width, K = 7 speculative tokens: EAGLE-3
``ttt_steps = 7``; DFlash ``block_size = 8`` (anchor + 7 masks, the anchor is the bonus token);
DSpark ``block_size = 7`` with ``sample_from_anchor`` (its default; 7 positions predict 7 tokens,
DLite's block layout). DSpark is trainable here; vLLM 0.32 serves it only on Model Runner V2 (GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch

PathLike = Union[str, Path]

METHODS = ("eagle3", "dflash", "dspark")
SERVABLE_ON_CPU = ("eagle3", "dflash")
K_DEFAULT = 7
BACKEND_NAME = "dlite_layers"
FEATURES_META = "dlite_features.json"
SHARED_TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")


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
    """Default vLLM aux ids for ``method`` on an N-layer target (see the module docstring)."""
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


def _target_config(target: PathLike) -> dict:
    path = Path(target) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{target} has no config.json (is the target trained yet?)")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg)


def _mask_token_id(target: PathLike) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    if mask is None or mask == tok.unk_token_id:
        raise ValueError(
            f"the tokenizer of {target} has no mask token; DFlash/DSpark need one "
            "(pass --mask-token-id)"
        )
    return int(mask)


# =========================================================================== 1. sequences
@dataclass
class Sequences:
    """Training rows: ``index[r]`` is the :class:`SequenceStore` index of row ``r`` (its feature
    file is ``hs_{index[r]}``, the naming DLite's own feature files use too)."""

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

    Same sequences as DLite's trainer: :class:`SequenceStore` (longer sequences keep their last
    ``max_len`` tokens) and every sequence with at least one anchor. ``loss_mask[p] = 1`` on the
    response tokens (``p >= prompt_len``).
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


# =========================================================================== 3a. backend
def register_layer_backend() -> str:
    """Register (once) the ``dlite_layers`` hidden-states backend with hs_connectors.

    speculators' ``file`` backend, extended for the stores of :func:`write_feature_store`: row
    ``r`` of the table reads ``hs_{file_index[r]}`` (from the store, else from its ``reuse``
    directory) and returns only ``target_layer_ids + [N]`` (the ids come from the file's
    metadata), so one store serves every method. Returns the backend name.
    """
    from hs_connectors import FileBackend, FileTransfer, HiddenStatesBackend

    if BACKEND_NAME in HiddenStatesBackend.registry:
        return BACKEND_NAME

    class LayerSelectTransfer(FileTransfer):
        def __init__(self, hidden_states_path: Path, select: list[int],
                     file_index: Optional[list[int]] = None, reuse: Optional[str] = None):
            super().__init__(hidden_states_path)
            self.select, self.file_index, self.reuse = select, file_index, reuse

        def _pick(self, path: Path):
            from vllm_dlite.train.features import read_hs_file

            if not path.exists():
                return None
            hs = read_hs_file(path, layer_ids=self.select)
            return {"hidden_states": hs.features, "token_ids": hs.token_ids}

        def get_cached(self, file_idx: int):
            i = self.file_index[file_idx] if self.file_index is not None else file_idx
            path = self.hidden_states_path / f"hs_{i}.safetensors"
            if not path.exists() and self.reuse:
                path = Path(self.reuse) / f"hs_{i}.safetensors"
            return self._pick(path)

        def get_generated(self, hs_transfer_params):
            handle = (hs_transfer_params.get("hidden_states_path")
                      or hs_transfer_params.get("handle"))
            return self._pick(Path(handle))

    @HiddenStatesBackend.register(BACKEND_NAME)
    class LayerSelectBackend(FileBackend):
        @staticmethod
        def add_train_args(parser: argparse.ArgumentParser) -> None:  # reuses --hidden-states-path
            pass

        @staticmethod
        def from_train_args(args: argparse.Namespace, data_path: str) -> FileTransfer:
            from speculators.models.utils import get_verifier_config

            n = get_verifier_config(args.verifier_name_or_path).num_hidden_layers
            ids = args.target_layer_ids
            if not ids:
                raise ValueError(f"the {BACKEND_NAME} backend needs explicit --target-layer-ids")
            hs_path = getattr(args, "hidden_states_path", None)
            path = Path(hs_path) if hs_path else Path(data_path) / "hidden_states"
            meta_path = Path(data_path) / FEATURES_META
            meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
            return LayerSelectTransfer(path, file_layer_ids(ids, n), meta.get("file_index"),
                                       meta.get("reuse"))

    return BACKEND_NAME


# =========================================================================== 3b. CPU safety
class _CpuStepTimer:
    """Drop-in for speculators' ``_StepTimer`` without ``torch.accelerator.synchronize``."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._marks: dict[str, float] = {}
        self._memory: dict[str, float] = {}

    def reset(self, enabled: bool) -> None:
        self.enabled = enabled
        self._marks.clear()

    def mark(self, name: str) -> None:
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def mark_value(self, name: str, value: float) -> None:
        if self.enabled:
            self._marks[name] = value

    def now(self) -> Optional[float]:
        return time.perf_counter() if self.enabled else None

    def profile(self, num_tokens: int) -> Optional[dict]:
        if not self.enabled:
            return None
        m = self._marks
        step_ms = (m["opt"] - m["start"]) * 1000
        return {
            "fetch_ms": (m["fetch"] - m["start"]) * 1000,
            "fwd_ms": (m["fwd"] - m["fetch"]) * 1000,
            "bwd_ms": (m["bwd"] - m["fwd"]) * 1000,
            "opt_ms": (m["opt"] - m["bwd"]) * 1000,
            "step_ms": step_ms,
            "tokens_per_s": num_tokens / (step_ms / 1000) if step_ms > 0 else 0.0,
        }


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                        eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation (torch.optim.Muon's iteration and
    coefficients), computed in float32: the CPU stand-in for torch's bf16 version."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(grad.dtype)


@contextlib.contextmanager
def cpu_safe_speculators() -> Iterator[None]:
    """Make speculators' single-process trainer run on a machine without an accelerator.

    speculators 0.9.0 assumes one: ``Trainer`` moves the model and batches to ``local_rank`` (an
    int, i.e. ``cuda:0``), autocasts on ``"cuda"``, its step timer calls
    ``torch.accelerator.synchronize()``, and resuming maps tensors to ``get_current_device()``
    (``"cuda:0"`` when there is none). Patched here at runtime, restored on exit; a no-op when an
    accelerator exists. The other CPU needs are plain flags (see :func:`speculators_argv`).

    Also on CPU: torch's Muon (speculators' default optimizer) orthogonalises each update in
    bfloat16, which a CPU without bf16 matrix units emulates ~100x slower than fp32 (1 vs 137
    GFLOP/s for a 1024^2 matmul on the 2-core CI machine: 4.4 s of a 9 s DFlash step). The same
    Newton-Schulz iteration runs in fp32 instead (:func:`_newton_schulz_fp32`).
    """
    if torch.accelerator.is_available():
        yield
        return
    import speculators.train.checkpointer as ckpt_mod
    import speculators.train.trainer as trainer_mod
    import torch.optim._muon as muon_mod

    saved = dict(
        newton_schulz=muon_mod._zeropower_via_newtonschulz,
        get_local_rank=trainer_mod.get_local_rank,
        step_timer=trainer_mod._StepTimer,
        init=trainer_mod.Trainer.__init__,
        current_device=ckpt_mod.get_current_device,
    )
    original_init = saved["init"]

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"  # torch.autocast("cpu", float32) is a (warned) no-op

    muon_mod._zeropower_via_newtonschulz = _newton_schulz_fp32
    trainer_mod.get_local_rank = lambda: "cpu"
    trainer_mod._StepTimer = _CpuStepTimer
    trainer_mod.Trainer.__init__ = init
    ckpt_mod.get_current_device = lambda: "cpu"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CPU autocast.*")
            warnings.filterwarnings("ignore", message=".*pin_memory.*")
            yield
    finally:
        muon_mod._zeropower_via_newtonschulz = saved["newton_schulz"]
        trainer_mod.get_local_rank = saved["get_local_rank"]
        trainer_mod._StepTimer = saved["step_timer"]
        trainer_mod.Trainer.__init__ = original_init
        ckpt_mod.get_current_device = saved["current_device"]


# =========================================================================== 3c. training
@dataclass
class BaselineRecipe:
    """One speculators run. Unset fields use the per-method defaults of this module."""

    method: str
    target: str
    features: str
    save_path: str
    epochs: int = 10
    layer_ids: Optional[list[int]] = None
    num_layers: Optional[int] = None  # eagle3: 1, dflash/dspark: 2
    num_speculative_tokens: int = K_DEFAULT
    ttt_steps: Optional[int] = None  # EAGLE-3 training-time-test steps (default K)
    lr: float = 1e-3
    optimizer: str = "muon"  # speculators' default
    total_seq_len: int = 4096
    max_anchors: int = 512
    markov_rank: int = 64  # DSpark (vocab x rank twice: 64 keeps it ~2 MB in bf16)
    max_steps: Optional[int] = None
    train_data_ratio: float = 0.98
    seed: int = 0
    log_freq: int = 10
    mask_token_id: Optional[int] = None
    extra: list[str] = field(default_factory=list)  # raw speculators flags, appended last

    def resolved_layer_ids(self) -> list[int]:
        n = int(_target_config(self.target)["num_hidden_layers"])
        ids = self.layer_ids or default_layer_ids(self.method, n)
        if sorted(set(ids)) != list(ids):
            raise ValueError(f"layer ids must be strictly increasing (vLLM sorts them): {ids}")
        if self.method == "eagle3" and len(ids) != 3:
            warnings.warn(f"EAGLE-3 is normally trained on 3 target layers, got {ids}",
                          stacklevel=2)
        return list(ids)


def speculators_argv(r: BaselineRecipe) -> list[str]:
    """The ``speculators train`` flags for a recipe (CPU-safe; also valid on GPU)."""
    if r.method not in METHODS:
        raise ValueError(f"unknown method {r.method!r}; choose one of {METHODS}")
    k = r.num_speculative_tokens
    num_layers = r.num_layers or (1 if r.method == "eagle3" else 2)
    argv = [
        "--speculator-type", r.method,
        "--verifier-name-or-path", str(r.target),
        "--data-path", str(r.features),
        "--save-path", str(r.save_path),
        "--log-dir", str(Path(r.save_path) / "logs"),
        "--hidden-states-backend", register_layer_backend(),
        "--target-layer-ids", *map(str, r.resolved_layer_ids()),
        "--num-layers", str(num_layers),
        "--epochs", str(r.epochs),
        "--lr", str(r.lr),
        "--optimizer", r.optimizer,
        "--total-seq-len", str(r.total_seq_len),
        "--train-data-ratio", str(r.train_data_ratio),
        "--seed", str(r.seed),
        "--log-freq", str(r.log_freq),
        "--on-missing", "raise",
    ]
    if not torch.accelerator.is_available():
        # CPU-safe settings (docs/design.md §8): no flex-attention backward and no fused
        # (Triton) loss on CPU, no spawned loader workers; fp32 compute (CPU autocast is bf16-only)
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
                 "--num-workers", "0", "--hidden-states-dtype", "float32"]
    if r.method == "eagle3":
        argv += ["--ttt-steps", str(r.ttt_steps or k)]
    else:
        mask = r.mask_token_id if r.mask_token_id is not None else _mask_token_id(r.target)
        # DFlash: anchor (bonus token) + K masks; DSpark samples from the anchor: K positions
        block = k + 1 if r.method == "dflash" else k
        argv += ["--block-size", str(block), "--max-anchors", str(r.max_anchors),
                 "--mask-token-id", str(mask)]
        if r.method == "dspark":
            argv += ["--markov-rank", str(r.markov_rank)]
    if r.max_steps is not None:
        argv += ["--max-steps", str(r.max_steps)]
    return argv + list(r.extra)


def run_speculators(argv: Sequence[str]) -> None:
    """Run speculators' trainer in this process (CPU-safe), like ``speculators train ARGV``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        if key in os.environ and not torch.accelerator.is_available():
            raise RuntimeError(f"{key} is set: distributed speculators training needs GPUs")
    register_layer_backend()
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(list(argv))
    with cpu_safe_speculators():
        speculators_main(cfg)


def last_checkpoint(save_path: PathLike) -> Path:
    """The highest-numbered epoch directory speculators wrote under ``save_path``."""
    epochs = [int(p.name) for p in Path(save_path).iterdir()
              if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    if not epochs:
        raise FileNotFoundError(f"no epoch checkpoint under {save_path}")
    return Path(save_path) / str(max(epochs))


# =========================================================================== 4. export
def export_checkpoint(src: PathLike, out: PathLike, target: PathLike, *,
                      dtype: torch.dtype = torch.bfloat16, readme: Optional[str] = None) -> Path:
    """Copy a speculators checkpoint to ``out`` as vLLM loads it, minus the target's weights.

    ``embed_tokens.weight`` / ``lm_head.weight`` are dropped when they are the (frozen) target
    tensors, so vLLM shares the target's (it does when a drafter checkpoint lacks them). Floating
    tensors are cast to ``dtype``. ``config.json`` is kept (speculators format), with the dtype
    field patched.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_dlite.train.features import TargetHead

    src, out = Path(src), Path(out)
    head = TargetHead.from_pretrained(target)
    shared = dict(zip(SHARED_TARGET_KEYS, (head.embed_weight, head.lm_head_weight)))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            ref = shared.get(name)
            if ref is not None and t.shape == ref.shape and torch.equal(t, ref.to(t.dtype)):
                continue
            tensors[name] = t.to(dtype) if t.is_floating_point() else t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = dtype_name
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if readme:
        (out / "README.md").write_text(readme)
    return out


def checkpoint_summary(path: PathLike) -> dict:
    """``{"params", "bytes", "tensors"}`` of an exported checkpoint."""
    from safetensors import safe_open

    path = Path(path)
    params, names = 0, []
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            numel = 1
            for dim in f.get_slice(name).get_shape():
                numel *= int(dim)
            params += numel
            names.append(name)
    return dict(params=params, bytes=(path / "model.safetensors").stat().st_size, tensors=names)


def vllm_speculative_config(method: str, model: PathLike, k: int = K_DEFAULT) -> dict:
    """The ``speculative_config`` that serves an exported baseline with vLLM."""
    if method == "dspark":
        warnings.warn("vLLM 0.32 serves DSpark only with Model Runner V2 (GPU)", stacklevel=2)
    return {"method": method, "model": str(model), "num_speculative_tokens": k}


# =========================================================================== CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dlite.train.baselines",
        description="Train an EAGLE-3 / DFlash / DSpark baseline drafter with speculators==0.9.0 "
        "on the target-regenerated data (CPU-safe), and export a vLLM-loadable checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--method", required=True, choices=METHODS)
    ap.add_argument("--target", required=True, help="HF directory of the target (verifier)")
    ap.add_argument("--data", required=True,
                    help="regenerated sequences: the JSONL of `python -m vllm_dlite.train.data` "
                    "(or a directory holding exactly one)")
    ap.add_argument("--out", required=True, help="exported drafter directory (vLLM loads it)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--work-dir", default="runs/baselines",
                    help="speculators checkpoints go to WORK_DIR/<out name>/checkpoints")
    ap.add_argument("--features", default=None,
                    help="shared hidden-state store (default WORK_DIR/features-<target name>)")
    ap.add_argument("--features-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reuse-features", default=None, metavar="HS_DIR",
                    help="read existing hs_{i}.safetensors (i = sequence index of --data, the "
                    "same --max-len) from HS_DIR instead of recomputing them, e.g. DLite's "
                    "runs/dlite-qwen3-tiny-stdlib/data/features/hidden_states")
    ap.add_argument("--store-layer-ids", type=int, nargs="+", default=None,
                    help="layers kept in a NEW store (default: 1..N)")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None,
                    help="vLLM aux ids the drafter reads (default: see module docstring)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="draft decoder layers (default eagle3 1, dflash/dspark 2)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=K_DEFAULT)
    ap.add_argument("--max-len", type=int, default=4096,
                    help="keep the last MAX_LEN tokens of each sequence; also the packed batch "
                    "length (speculators --total-seq-len)")
    ap.add_argument("--max-sequences", type=int, default=None, help="use the first N sequences")
    ap.add_argument("--ttt-steps", type=int, default=None,
                    help="EAGLE-3 training-time-test steps (default K; 3 = speculators' default, "
                    "~3x cheaper on CPU)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    ap.add_argument("--max-anchors", type=int, default=512, help="DFlash/DSpark anchors per batch")
    ap.add_argument("--markov-rank", type=int, default=64, help="DSpark Markov head rank")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="DFlash/DSpark placeholder token (default: the tokenizer's <|mask|>)")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--train-data-ratio", type=float, default=0.98,
                    help="speculators keeps the rest (after a fixed shuffle) for validation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-freq", type=int, default=10)
    ap.add_argument("--fresh", action="store_true",
                    help="delete this run's speculators checkpoints first (default: resume)")
    ap.add_argument("--features-only", action="store_true", help="write the store and stop")
    ap.add_argument("--speculators-arg", action="append", default=[], metavar="FLAG",
                    help="extra raw `speculators train` flag (repeatable; use --speculators-arg=--x)")
    return ap


def main(argv: Optional[list[str]] = None) -> Path:
    args = build_parser().parse_args(argv)
    t_start = time.time()
    target = Path(args.target)
    n = int(_target_config(target)["num_hidden_layers"])
    work = Path(args.work_dir)
    features = Path(args.features) if args.features else work / f"features-{target.name}"
    out = Path(args.out)

    # 1-2. sequences and the shared feature store
    if (features / FEATURES_META).is_file() and args.store_layer_ids is None:
        store_ids = read_store_layer_ids(features)
    else:
        store_ids = sorted(set(args.store_layer_ids or store_layer_ids(n, [args.layer_ids or []]))
                           | {n})
    sequences = load_sequences(args.data, args.max_len)
    if args.max_sequences:
        sequences = sequences.select(range(min(args.max_sequences, len(sequences))))
    # fixed shuffle: the JSONL is grouped by workload kind, speculators' validation split is its tail
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
    sequences = sequences.select(order)
    print(f"[baselines] {len(sequences)} sequences, {sequences.num_tokens} tokens; "
          f"feature store {features} layers {store_ids}", flush=True)
    t0 = time.time()
    write_feature_store(target, sequences, features, store_ids,
                        dtype=getattr(torch, args.features_dtype), reuse=args.reuse_features,
                        source=str(args.data))
    t_features = time.time() - t0
    if args.features_only:
        return features

    # 3. speculators training
    recipe = BaselineRecipe(
        method=args.method, target=str(target), features=str(features),
        save_path=str(work / out.name / "checkpoints"), epochs=args.epochs,
        layer_ids=args.layer_ids, num_layers=args.num_layers,
        num_speculative_tokens=args.num_speculative_tokens, ttt_steps=args.ttt_steps, lr=args.lr,
        optimizer=args.optimizer, total_seq_len=args.max_len, max_anchors=args.max_anchors,
        markov_rank=args.markov_rank, max_steps=args.max_steps,
        train_data_ratio=args.train_data_ratio, seed=args.seed, log_freq=args.log_freq,
        mask_token_id=args.mask_token_id, extra=list(args.speculators_arg),
    )
    missing = [i for i in recipe.resolved_layer_ids() if i not in store_ids]
    if missing:
        raise ValueError(f"layer ids {missing} are not in the feature store {features} "
                         f"(holds {store_ids}); pass --store-layer-ids with a new --features dir")
    if args.fresh and Path(recipe.save_path).exists():
        shutil.rmtree(recipe.save_path)
    spec_argv = speculators_argv(recipe)
    print("[baselines] speculators train " + shlex.join(spec_argv), flush=True)
    t0 = time.time()
    run_speculators(spec_argv)
    t_train = time.time() - t0

    # 4. export
    src = last_checkpoint(recipe.save_path)
    cmd = shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "vllm_dlite.train.baselines",
                      *(argv if argv is not None else sys.argv[1:])])
    readme = _readme(args.method, recipe, spec_argv, cmd, len(sequences), sequences.num_tokens,
                     t_features, t_train, src)
    export_checkpoint(src, out, target, readme=readme)
    info = checkpoint_summary(out)
    print(f"[baselines] {args.method} -> {out} ({info['params'] / 1e6:.2f}M params, "
          f"{info['bytes'] / 2**20:.2f} MiB), total {time.time() - t_start:.0f}s", flush=True)
    return out


def _readme(method, recipe, spec_argv, cmd, n_seq, n_tok, t_features, t_train, src) -> str:
    serve = json.dumps(vllm_speculative_config(method, "<this dir>", recipe.num_speculative_tokens)
                       ) if method in SERVABLE_ON_CPU else (
        '{"method": "dspark", ...}: vLLM 0.32 serves DSpark on Model Runner V2 (GPU) only')
    return f"""# {method} baseline drafter for {Path(recipe.target).name}

Trained with speculators==0.9.0 (vLLM's drafter-training library) on the target-regenerated data
(same sequences as DLite), exported by `vllm_dlite.train.baselines`. The target's embed_tokens and
lm_head are not stored: vLLM shares the target's.

- command: `{cmd}`
- speculators: `speculators train {shlex.join(spec_argv)}`
- target layers (vLLM aux ids, residual after i layers, pre-norm): {recipe.resolved_layer_ids()}
- data: {n_seq} sequences, {n_tok} tokens; features {t_features:.0f}s, training {t_train:.0f}s
  (device: {"cuda" if torch.cuda.is_available() else "cpu"}), checkpoint {src.name}
- serve: `LLM(target, speculative_config={serve})`
"""


if __name__ == "__main__":
    main()


__all__ = [
    "METHODS",
    "BaselineRecipe",
    "cpu_safe_speculators",
    "default_layer_ids",
    "export_checkpoint",
    "file_layer_ids",
    "last_checkpoint",
    "load_sequences",
    "main",
    "register_layer_backend",
    "run_speculators",
    "speculators_argv",
    "store_layer_ids",
    "vllm_speculative_config",
    "write_feature_store",
]
