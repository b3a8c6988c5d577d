"""Runtime patches that let ``speculators==0.9.0`` train the baselines of
:mod:`lab.baselines` here; nothing in site-packages is edited.
:func:`register_layer_backend` adds the ``dlite_layers`` hidden-states backend (speculators' backend
plugin interface) that reads each method's layers out of the shared store of
:func:`~lab.baselines.features.write_feature_store`; :func:`cpu_safe_speculators` is a
context manager that, on a machine without an accelerator, replaces the accelerator-only calls
of speculators' trainer (device placement, autocast, step timer, checkpoint device), torch
Muon's bf16 Newton-Schulz step and the dense masked SDPA of the draft models
(:func:`masked_sdpa_tiles`) by CPU equivalents, keeps freed memory in glibc's heap, and restores
them on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

from .features import FEATURES_META, file_layer_ids

BACKEND_NAME = "dlite_layers"


# =========================================================================== 3a. backend
def register_layer_backend() -> str:
    """Register (once) the ``dlite_layers`` hidden-states backend with hs_connectors.

    speculators' ``file`` backend, extended for the stores of
    :func:`~lab.baselines.features.write_feature_store`: row ``r`` of the table reads
    ``hs_{file_index[r]}`` (from the store, else from its ``reuse`` directory) and returns only
    ``target_layer_ids + [N]`` (the ids come from the file's metadata), so one store serves every
    method. Returns the backend name.
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


MASKED_ATTENTION_TILE = 128  # query rows per tile (fastest of 64/128/256 on the tiny target)


def masked_sdpa_tiles(dense_sdpa, tile: int = MASKED_ATTENTION_TILE):
    """An attention function (transformers' ``AttentionInterface`` signature) that computes
    ``dense_sdpa`` with a boolean mask tile by tile, each query tile on only the key columns its
    mask rows attend to; the same result and gradients as ``dense_sdpa`` (masked columns weigh
    exactly 0; a fully masked tile keeps one masked column, so its rows see what they saw).

    speculators' CPU path (``--draft-attn-impl sdpa``) hands SDPA a dense ``[Q, KV]`` boolean mask:
    EAGLE-3's training-time test attends to ``KV = (step + 1) x T`` keys of which a query sees its
    document prefix and one key per earlier step (2 % of the mask at 7 steps, T = 4,096), DFlash's
    4,096 block queries to ``2 x T`` keys (3 %), and torch's CPU flash kernel computes every column.
    With 128-row tiles 5 % of that work is left (the captured masks of a real step: 0.68 s instead
    of 6.9 s forward + backward for EAGLE-3's 7th step, 0.13 s instead of 1.5 s for a DFlash
    layer). Anything else (no or a float mask, dropout, a mask broadcast over queries, a mask
    whose tiles keep over half the columns) goes to ``dense_sdpa`` unchanged.
    """

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q_len, kv_len = query.shape[-2], key.shape[-2]
        mask = attention_mask
        if (mask is None or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                or mask.shape[-2:] != (q_len, kv_len) or dropout or q_len <= tile
                or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None):
            return dense_sdpa(module, query, key, value, attention_mask, dropout=dropout,
                              scaling=scaling, **kwargs)
        starts = range(0, q_len, tile)
        cols = [mask[..., s:s + tile, :].flatten(0, -2).any(0).nonzero().flatten() for s in starts]
        cols = [c if c.numel() else c.new_zeros(1) for c in cols]
        sizes = [c.numel() for c in cols]
        if 2 * sum(sizes) > kv_len * len(sizes):  # too dense to gain
            return dense_sdpa(module, query, key, value, attention_mask, dropout=dropout,
                              scaling=scaling, **kwargs)
        index = torch.cat(cols)  # one gather (and one scatter in backward) for all tiles
        keys = key.index_select(-2, index).split(sizes, dim=-2)
        values = value.index_select(-2, index).split(sizes, dim=-2)
        outs = []
        for s, c, k, v in zip(starts, cols, keys, values):
            out, _ = dense_sdpa(module, query[..., s:s + tile, :], k, v,
                                mask[..., s:s + tile, :].index_select(-1, c), dropout=dropout,
                                scaling=scaling, **kwargs)
            outs.append(out)
        return torch.cat(outs, dim=1), None  # [B, Q, H, D], as transformers' sdpa returns

    return attention


def _attention_interfaces() -> list:
    """The two attention registries the draft models read ``"sdpa"`` from: transformers' (EAGLE-3's
    decoder layers are transformers' own) and speculators' (DFlash/DSpark attention)."""
    import speculators.models.attention as spec_attention
    import transformers.modeling_utils as hf_modeling

    return [hf_modeling.ALL_ATTENTION_FUNCTIONS, spec_attention.ALL_ATTENTION_FUNCTIONS]


@contextlib.contextmanager
def _heap_reuse() -> Iterator[None]:
    """glibc malloc: serve every allocation from the heap and keep freed memory there, restored
    (and the heap trimmed) on exit; a no-op without glibc.

    glibc maps each block above its mmap threshold (at most 32 MiB) afresh and unmaps it on free,
    so every logits-sized tensor of a step ([4,096 x 8,192] fp32: 128 MiB) is page-faulted and
    zeroed again (~80 ms each on this VM, dozens per step). Reusing the freed heap instead took a
    DFlash step from 3.3 to 2.4 s and an EAGLE-3 step (7 TTT steps) from 19.1 to 14.4 s (same
    shared CPU), at ~+0.2 GiB peak RSS for DFlash.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    m_trim_threshold, m_mmap_max = -1, -4
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, 2**31 - 1)
    try:
        yield
    finally:
        mallopt(m_mmap_max, 65536)  # glibc's defaults
        mallopt(m_trim_threshold, 128 * 1024)
        malloc_trim(0)


@contextlib.contextmanager
def cpu_safe_speculators() -> Iterator[None]:
    """Make speculators' single-process trainer run on a machine without an accelerator.

    speculators 0.9.0 assumes one: ``Trainer`` moves the model and batches to ``local_rank`` (an
    int, i.e. ``cuda:0``), autocasts on ``"cuda"``, its step timer calls
    ``torch.accelerator.synchronize()``, and resuming maps tensors to ``get_current_device()``
    (``"cuda:0"`` when there is none). Patched here at runtime, restored on exit; a no-op when an
    accelerator exists. The other CPU needs are plain flags (see
    :func:`~lab.baselines.speculators_argv`).

    Also on CPU: torch's Muon (speculators' default optimizer) orthogonalises each update in
    bfloat16, which a CPU without bf16 matrix units emulates ~100x slower than fp32 (1 vs 137
    GFLOP/s for a 1024^2 matmul on the 2-core CI machine: 4.4 s of a 9 s DFlash step). The same
    Newton-Schulz iteration runs in fp32 instead (:func:`_newton_schulz_fp32`). Everything else
    already trains in fp32 here (drafter, its frozen ``embed_tokens``/``lm_head``/``verifier_norm``
    copies, optimizer states: speculators keeps fp32 master weights; hidden states with
    ``--hidden-states-dtype float32``; autocast on CPU in fp32 is a no-op), and the remaining time
    went to SDPA over dense masks (56-57 % of a step), computed tile-sparse instead
    (:func:`masked_sdpa_tiles`), and to page faults of large tensors (:func:`_heap_reuse`).
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
    interfaces = _attention_interfaces()
    saved_sdpa = [(i, i._local_mapping.get("sdpa")) for i in interfaces]

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"  # torch.autocast("cpu", float32) is a (warned) no-op

    muon_mod._zeropower_via_newtonschulz = _newton_schulz_fp32
    trainer_mod.get_local_rank = lambda: "cpu"
    trainer_mod._StepTimer = _CpuStepTimer
    trainer_mod.Trainer.__init__ = init
    ckpt_mod.get_current_device = lambda: "cpu"
    for interface in interfaces:
        interface["sdpa"] = masked_sdpa_tiles(interface["sdpa"])
    try:
        with warnings.catch_warnings(), _heap_reuse():
            warnings.filterwarnings("ignore", message=".*CPU autocast.*")
            warnings.filterwarnings("ignore", message=".*pin_memory.*")
            yield
    finally:
        muon_mod._zeropower_via_newtonschulz = saved["newton_schulz"]
        trainer_mod.get_local_rank = saved["get_local_rank"]
        trainer_mod._StepTimer = saved["step_timer"]
        trainer_mod.Trainer.__init__ = original_init
        ckpt_mod.get_current_device = saved["current_device"]
        for interface, local in saved_sdpa:
            if local is None:
                del interface["sdpa"]
            else:
                interface["sdpa"] = local


__all__ = ["BACKEND_NAME", "cpu_safe_speculators", "masked_sdpa_tiles", "register_layer_backend"]
