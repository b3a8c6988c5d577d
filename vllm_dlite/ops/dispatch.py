"""Pick the CUDA op or the PyTorch reference for each DLite op call.

``draft_attention`` and ``sequential_head`` have exactly the signatures of
:mod:`vllm_dlite.ops.reference`. A call goes to the ``torch.ops.dlite`` CUDA kernel when the
compiled library is loaded (``vllm_dlite._C``, built by ``setup.py`` with CUDA), the inputs are on a
CUDA device, and dtypes/shapes are ones the kernel handles; otherwise to the reference, which stays
the specification. :func:`backend_report` says which path is used and why.

The decision depends only on tensor metadata (device, dtype, shape, contiguity), so it is stable
under torch.compile tracing and CUDA-graph capture; pointer alignment is checked only in eager mode.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_dlite.ops import cuda_ops, reference
from vllm_dlite.ops.sampling import is_greedy

_ATTN_HEAD_DIMS = (32, 64, 128, 256)
_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ATTN_SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may opt into on sm_80 / sm_90
_ATTN_WARPS = 8  # query rows per CTA (csrc/draft_attention.cu kAttnWarps)
_HEAD_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_ALIGN = 64  # r and H must be multiples of this (csrc/sequential_head.cu k-slices, MMA tiles)
_HEAD_MAX_RANK = 1024  # csrc/sequential_head.cu kMaxRank (o staged whole in shared memory)
_MIN_CAPABILITY = (8, 0)  # mma.sync bf16

_last: dict[str, str] = {}  # op -> "cuda" / "reference (<why>)" of the latest eager call
_UNSET = object()
_library_state: object = _UNSET  # cached _probe_library() result: None (usable) or a reason


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def refresh_backend() -> None:
    """Forget the cached library probe (call after loading a CUDA build of ``csrc/`` by hand,
    e.g. ``torch.utils.cpp_extension.load``)."""
    global _library_state
    _library_state = _UNSET


def _library_reason() -> Optional[str]:
    """Why the CUDA kernels cannot be used at all (None when they are registered). Probed once
    and cached, so traced code only reads a module global."""
    global _library_state
    if _library_state is _UNSET:
        _library_state = _probe_library()
    return _library_state  # type: ignore[return-value]


def _probe_library() -> Optional[str]:
    err = cuda_ops.registration_error()
    if err is not None:
        return f"dlite ops not registered: {err}"
    if cuda_ops.cuda_kernels_registered():
        return None
    ext_err = cuda_ops.load_extension()
    if cuda_ops.cuda_kernels_registered():
        return None
    if ext_err is not None:
        return f"{cuda_ops.EXTENSION} not built: {ext_err.splitlines()[0]}"
    return (f"{cuda_ops.EXTENSION} imported but registered no dlite_v1 CUDA kernels "
            "(a stale build of the old ops? rebuild it)")


def _device_reason(tensors: list[torch.Tensor]) -> Optional[str]:
    dev = tensors[0].device
    if dev.type != "cuda":
        return f"inputs on {dev.type}"
    if any(t.device != dev for t in tensors):
        return "inputs on several devices"
    if not _compiling() and torch.cuda.get_device_capability(dev) < _MIN_CAPABILITY:
        return "GPU older than sm_80"
    return None


def _misaligned(tensors: list[torch.Tensor]) -> bool:
    """A contiguous input whose data does not start on 16 bytes (the kernels' vector width).
    Non-contiguous inputs are copied by the binding, so they are aligned by then."""
    if _compiling():
        return False  # fake tensors have no storage; the binding checks again at run time
    return any(t.is_contiguous() and t.data_ptr() % 16 for t in tensors)


def _record(op: str, decision: str) -> None:
    if not _compiling():
        _last[op] = decision


# ------------------------------------------------------------------------------ draft attention
def _attention_reason(q, k_ctx, v_ctx, k_q, v_q, cos, sin) -> Optional[str]:
    tensors = [q, k_ctx, v_ctx, k_q, v_q, cos, sin]
    if any(t.dim() != (2 if t is cos or t is sin else 4) for t in tensors):
        return "shape check"
    b, Q, Hq, D = q.shape
    L, Hkv = k_ctx.shape[1], k_ctx.shape[2]
    if (
        k_ctx.shape != (b, L, Hkv, D)
        or v_ctx.shape != k_ctx.shape
        or k_q.shape != (b, Q, Hkv, D)
        or v_q.shape != k_q.shape
        or cos.shape != (L + Q, D)
        or sin.shape != cos.shape
        or Hkv == 0
        or Hq % Hkv
    ):
        return "shape check"  # the reference raises the documented ValueError
    why = _device_reason(tensors) or _library_reason()
    if why:
        return why
    if q.dtype not in _ATTN_DTYPES or any(t.dtype != q.dtype for t in tensors[1:5]):
        return f"dtype {q.dtype} not supported"
    if not (cos.dtype.is_floating_point and sin.dtype.is_floating_point):
        return "cos/sin not floating point"
    if D not in _ATTN_HEAD_DIMS:
        return f"head_dim {D} not in {_ATTN_HEAD_DIMS}"
    if Q == 0 or b > 65535:
        return "no query slots or batch > 65535"
    if (2 * (L + Q) * D + _ATTN_WARPS * (L + Q)) * 4 > _ATTN_SMEM_LIMIT:
        return "L + Q too large"
    if _misaligned([q, k_ctx, v_ctx, k_q, v_q]):
        return "inputs not 16-byte aligned"
    return None


def draft_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_q: torch.Tensor,
    v_q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dispatched :func:`vllm_dlite.ops.reference.draft_attention` (same contract)."""
    why = _attention_reason(q, k_ctx, v_ctx, k_q, v_q, cos, sin)
    if why is None:
        _record("draft_attention", "cuda")
        return torch.ops.dlite.draft_attention_v1(q, k_ctx, v_ctx, k_q, v_q, cos, sin, float(scale))
    _record("draft_attention", f"reference ({why})")
    return reference.draft_attention(q, k_ctx, v_ctx, k_q, v_q, cos, sin, scale)


# ------------------------------------------------------------------------------ sequential head
def _head_reason(d, anchor_ids, prime_ids, P, W_s, b_s, W_f, b_f, W_o, temperature,
                 k) -> Optional[str]:
    if d.dim() != 3 or W_o.dim() != 2:
        return "shape check"
    b, K, H = d.shape
    if (
        not 0 <= k <= K
        or anchor_ids.shape != (b,)
        or (prime_ids is not None and prime_ids.shape != (b,))
        or temperature < 0
    ):
        return "shape check"  # the reference raises the documented ValueError
    if not is_greedy(temperature):
        return "sampling (temperature > 0): the kernel is greedy only"
    tensors = [d, anchor_ids] + ([prime_ids] if prime_ids is not None else []) + [
        P, W_s, b_s, W_f, b_f, W_o]
    why = _device_reason(tensors) or _library_reason()
    if why:
        return why
    V, r = W_o.shape
    if W_o.dtype not in _HEAD_DTYPES:
        return f"output_proj dtype {W_o.dtype} not supported (bf16/fp16)"
    if any(t.dtype != W_o.dtype for t in (P, W_s, b_s, W_f, b_f)):
        return "head weights not all in output_proj's dtype"
    if not d.dtype.is_floating_point:
        return f"d dtype {d.dtype} not floating point"
    if anchor_ids.dtype != torch.int64 or (prime_ids is not None and prime_ids.dtype != torch.int64):
        return "anchor/prime ids not int64"
    if (
        P.shape != (V, r)
        or W_s.shape != (2 * r, 2 * r)
        or b_s.shape != (2 * r,)
        or W_f.shape != (r, r + H)
        or b_f.shape != (r,)
    ):
        return "head weight shapes (P [V, r], W_s [2r, 2r], W_f [r, r+H])"
    if r % _HEAD_ALIGN or r > _HEAD_MAX_RANK:
        return f"rank {r} not a multiple of {_HEAD_ALIGN} in {_HEAD_ALIGN}..{_HEAD_MAX_RANK}"
    if H % _HEAD_ALIGN:
        return f"hidden size {H} not a multiple of {_HEAD_ALIGN}"
    if V >= 2**31:
        return f"vocabulary {V} >= 2^31"
    if not (W_o.is_contiguous() and P.is_contiguous()):
        return "output_proj / prev_token_embedding not contiguous"
    if _misaligned([P, W_s, W_f, W_o] + ([d] if d.dtype == W_o.dtype else [])):
        return "inputs not 16-byte aligned"
    return None


def sequential_head(
    d: torch.Tensor,
    anchor_ids: torch.Tensor,
    prime_ids: Optional[torch.Tensor],
    prev_token_embedding: torch.Tensor,
    state_proj_weight: torch.Tensor,
    state_proj_bias: torch.Tensor,
    hidden_mlp_weight: torch.Tensor,
    hidden_mlp_bias: torch.Tensor,
    output_proj_weight: torch.Tensor,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    k: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatched :func:`vllm_dlite.ops.reference.sequential_head` (same contract). The kernel
    is greedy only: sampling (not :func:`vllm_dlite.ops.sampling.is_greedy`) uses the reference."""
    k = (d.shape[1] if d.dim() == 3 else 0) if k is None else int(k)
    why = _head_reason(d, anchor_ids, prime_ids, prev_token_embedding, state_proj_weight,
                       state_proj_bias, hidden_mlp_weight, hidden_mlp_bias, output_proj_weight,
                       temperature, k)
    if why is None:
        _record("sequential_head", "cuda")
        return torch.ops.dlite.sequential_head_greedy_v1(
            d, anchor_ids, prime_ids, prev_token_embedding, state_proj_weight, state_proj_bias,
            hidden_mlp_weight, hidden_mlp_bias, output_proj_weight, k,
        )
    _record("sequential_head", f"reference ({why})")
    return reference.sequential_head(
        d, anchor_ids, prime_ids, prev_token_embedding, state_proj_weight, state_proj_bias,
        hidden_mlp_weight, hidden_mlp_bias, output_proj_weight,
        temperature=temperature, generator=generator, k=k,
    )


# ------------------------------------------------------------------------------ report
def backend_report() -> str:
    """Which path the ops take and why, e.g. ``reference (vllm_dlite._C not built)``.

    First line: the backend available for CUDA inputs. Then one line per op with the decision of
    its latest (eager) call, if any.
    """
    why = _library_reason()
    if why is None:
        if torch.cuda.is_available():
            head = "cuda (dlite CUDA kernels registered; used for supported CUDA inputs)"
        else:
            head = "reference (dlite CUDA kernels registered, but no CUDA device)"
    else:
        head = f"reference ({why})"
    lines = [head]
    for op in ("draft_attention", "sequential_head"):
        lines.append(f"  {op}: last call -> {_last.get(op, 'none yet')}")
    return "\n".join(lines)


__all__ = ["backend_report", "draft_attention", "refresh_backend", "sequential_head"]
