"""The ``dlite::`` torch custom ops: schemas, fake (meta) implementations, CPU implementations.

Everything here is pure Python, so the ops exist (and can be traced by torch.compile or checked with
``torch.library.opcheck``) without the compiled extension. The CUDA kernels come from the optional
library ``vllm_dlite._C`` (``csrc/binding.cpp``), which registers them for the CUDA dispatch key
with ``TORCH_LIBRARY_IMPL(dlite, CUDA, m)``. The CPU implementations call the PyTorch reference, so
the op and the reference agree by construction on CPU.

Ops (format ``dlite_v1``; the ``_v1`` suffix keeps a stale build of the old kernels, which
registered ``draft_attention`` / ``sequential_head_greedy``, from ever being picked):
    ``dlite::draft_attention_v1(q, k_ctx, v_ctx, k_q, v_q, cos, sin, float scale) -> Tensor``
    ``dlite::sequential_head_greedy_v1(d, anchor_ids, prime_ids?, prev_token_embedding,
    state_proj_weight, state_proj_bias, hidden_mlp_weight, hidden_mlp_bias, output_proj_weight,
    int k) -> (Tensor draft_ids, Tensor logits)``
Semantics: :mod:`vllm_dlite.ops.reference` (``draft_attention``; ``sequential_head`` with
temperature 0).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from vllm_dlite.ops import reference

NAMESPACE = "dlite"
SCHEMAS = {
    "draft_attention_v1": (
        "(Tensor q, Tensor k_ctx, Tensor v_ctx, Tensor k_q, Tensor v_q, Tensor cos, Tensor sin, "
        "float scale) -> Tensor"
    ),
    "sequential_head_greedy_v1": (
        "(Tensor d, Tensor anchor_ids, Tensor? prime_ids, Tensor prev_token_embedding, "
        "Tensor state_proj_weight, Tensor state_proj_bias, Tensor hidden_mlp_weight, "
        "Tensor hidden_mlp_bias, Tensor output_proj_weight, int k) -> (Tensor, Tensor)"
    ),
}
EXTENSION = "vllm_dlite._C"


def _schema_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", "")
        return True
    except RuntimeError:
        return False


def _draft_attention_fake(q, k_ctx, v_ctx, k_q, v_q, cos, sin, scale):
    return q.new_empty(q.shape)


def _sequential_head_greedy_fake(d, anchor_ids, prime_ids, prev_token_embedding,
                                 state_proj_weight, state_proj_bias, hidden_mlp_weight,
                                 hidden_mlp_bias, output_proj_weight, k):
    b = d.shape[0]
    V = output_proj_weight.shape[0]
    return (
        d.new_empty((b, k), dtype=torch.int64),
        d.new_empty((b, k, V), dtype=torch.float32),
    )


def _draft_attention_cpu(q, k_ctx, v_ctx, k_q, v_q, cos, sin, scale):
    return reference.draft_attention(q, k_ctx, v_ctx, k_q, v_q, cos, sin, scale)


def _sequential_head_greedy_cpu(d, anchor_ids, prime_ids, prev_token_embedding,
                                state_proj_weight, state_proj_bias, hidden_mlp_weight,
                                hidden_mlp_bias, output_proj_weight, k):
    return reference.sequential_head(
        d, anchor_ids, prime_ids, prev_token_embedding, state_proj_weight, state_proj_bias,
        hidden_mlp_weight, hidden_mlp_bias, output_proj_weight, temperature=0.0,
        k=k,
    )


_FAKES = {
    "draft_attention_v1": _draft_attention_fake,
    "sequential_head_greedy_v1": _sequential_head_greedy_fake,
}
_CPU_IMPLS = {
    "draft_attention_v1": _draft_attention_cpu,
    "sequential_head_greedy_v1": _sequential_head_greedy_cpu,
}

_registration_error: Optional[str] = None


def register() -> Optional[str]:
    """Define the ops, their fakes and CPU impls once per process. Returns an error or None."""
    global _registration_error
    try:
        for name, schema in SCHEMAS.items():
            if _schema_exists(name):  # re-import / reload: already registered
                continue
            qualname = f"{NAMESPACE}::{name}"
            torch.library.define(qualname, schema)
            torch.library.register_fake(qualname, _FAKES[name])
            torch.library.impl(qualname, "cpu", _CPU_IMPLS[name])
        _registration_error = None
    except Exception as exc:  # an unusual torch build must not break the package import
        _registration_error = f"{type(exc).__name__}: {exc}"
    return _registration_error


def registration_error() -> Optional[str]:
    return _registration_error


_extension_error: Optional[str] = None
_extension_tried = False


def load_extension() -> Optional[str]:
    """Import ``vllm_dlite._C`` once (registers the CUDA kernels). Returns the failure, or None."""
    global _extension_error, _extension_tried
    if not _extension_tried:
        _extension_tried = True
        try:
            importlib.import_module(EXTENSION)
            _extension_error = None
        except Exception as exc:  # ImportError when not built; OSError on a CUDA/torch mismatch
            _extension_error = f"{type(exc).__name__}: {exc}"
    return _extension_error


def cuda_kernels_registered() -> bool:
    """True when a CUDA implementation of both ops is registered (by ``vllm_dlite._C`` or by a
    JIT-built copy of ``csrc/`` loaded with ``torch.ops.load_library``)."""
    if _registration_error is not None:
        return False
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CUDA")
        for name in SCHEMAS
    )


register()
