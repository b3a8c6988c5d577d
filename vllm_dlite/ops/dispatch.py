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

_ATTN_HEAD_DIMS = (32, 64, 128, 256)
_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ATTN_SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may opt into on sm_80 / sm_90
_ATTN_WARPS = 8  # query rows per CTA (csrc/draft_attention.cu kAttnWarps)
_HEAD_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_CHUNK = 256  # H must be a multiple of the kernel's X stage (csrc/sequential_head.cu kChunk)
_HEAD_MAX_RANK = 1024  # csrc/sequential_head.cu kMaxRank
_MIN_CAPABILITY = (8, 0)  # mma.sync bf16 + cp.async

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
    return f"{cuda_ops.EXTENSION} imported but registered no CUDA kernels"


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
def _attention_reason(q, k_feat, v_feat, k_block, v_block, cos, sin) -> Optional[str]:
    tensors = [q, k_feat, v_feat, k_block, v_block, cos, sin]
    if any(t.dim() != (2 if t is cos or t is sin else 4) for t in tensors):
        return "shape check"
    B, K, Hq, D = q.shape
    L, Hkv = k_feat.shape[1], k_feat.shape[2]
    if (
        k_feat.shape != (B, L, Hkv, D)
        or v_feat.shape != k_feat.shape
        or k_block.shape != (B, K, Hkv, D)
        or v_block.shape != k_block.shape
        or cos.shape != (K + 1, D)
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
    if K == 0 or B > 65535:
        return "block size 0 or batch > 65535"
    if (2 * (L + K) * D + _ATTN_WARPS * (L + K)) * 4 > _ATTN_SMEM_LIMIT:
        return "L + K too large"
    if _misaligned([q, k_feat, v_feat, k_block, v_block]):
        return "inputs not 16-byte aligned"
    return None


def draft_attention(
    q: torch.Tensor,
    k_feat: torch.Tensor,
    v_feat: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dispatched :func:`vllm_dlite.ops.reference.draft_attention` (same contract)."""
    why = _attention_reason(q, k_feat, v_feat, k_block, v_block, cos, sin)
    if why is None:
        _record("draft_attention", "cuda")
        return torch.ops.dlite.draft_attention(
            q, k_feat, v_feat, k_block, v_block, cos, sin, float(scale)
        )
    _record("draft_attention", f"reference ({why})")
    return reference.draft_attention(q, k_feat, v_feat, k_block, v_block, cos, sin, scale)


# ------------------------------------------------------------------------------ sequential head
def _head_reason(
    h, anchor_ids, embed_weight, w_in, w_state, w_out, norm_weight, lm_head_weight,
    temperature, forced_ids,
) -> Optional[str]:
    if temperature != 0.0:
        return "sampling (temperature > 0) runs the reference"
    if forced_ids is not None:
        return "teacher forcing runs the reference"
    if h.dim() != 3 or w_in.dim() != 2 or lm_head_weight.dim() != 2 or embed_weight.dim() != 2:
        return "shape check"
    B, K, H = h.shape
    r = w_in.shape[0]
    if (
        anchor_ids.shape != (B,)
        or w_in.shape != (r, H)
        or w_state.shape != (r, r)
        or w_out.shape != (H, r)
        or norm_weight.shape != (H,)
        or lm_head_weight.shape[1] != H
        or embed_weight.shape[1] != H
    ):
        return "shape check"
    tensors = [h, anchor_ids, embed_weight, w_in, w_state, w_out, norm_weight, lm_head_weight]
    why = _device_reason(tensors) or _library_reason()
    if why:
        return why
    dt = lm_head_weight.dtype
    if dt not in _HEAD_DTYPES:
        return f"lm_head dtype {dt} not bf16/fp16"
    if any(t.dtype != dt for t in (h, embed_weight, w_in, w_state, w_out, norm_weight)):
        return "head tensors do not all have lm_head's dtype"
    if anchor_ids.dtype != torch.int64:
        return "anchor_ids not int64"
    if H % _HEAD_CHUNK:
        return f"hidden size {H} not a multiple of {_HEAD_CHUNK}"
    if r % 16 or not 16 <= r <= _HEAD_MAX_RANK:
        return f"rank {r} not a multiple of 16 in [16, {_HEAD_MAX_RANK}]"
    if lm_head_weight.shape[0] >= 2**31:
        return "vocabulary too large"
    if not (lm_head_weight.is_contiguous() and embed_weight.is_contiguous()):
        return "lm_head / embedding not contiguous"
    if _misaligned([h, embed_weight, w_in, w_state, w_out, lm_head_weight]):
        return "inputs not 16-byte aligned"
    return None


def sequential_head(
    h: torch.Tensor,
    anchor_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    w_in: torch.Tensor,
    w_state: torch.Tensor,
    w_out: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    eps: float,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    forced_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatched :func:`vllm_dlite.ops.reference.sequential_head` (same contract). The CUDA op
    covers the greedy, free-running case; sampling and teacher forcing use the reference."""
    why = _head_reason(
        h, anchor_ids, embed_weight, w_in, w_state, w_out, norm_weight, lm_head_weight,
        temperature, forced_ids,
    )
    if why is None:
        _record("sequential_head", "cuda")
        return torch.ops.dlite.sequential_head_greedy(
            h, anchor_ids, embed_weight, w_in, w_state, w_out, norm_weight, lm_head_weight,
            float(eps),
        )
    _record("sequential_head", f"reference ({why})")
    return reference.sequential_head(
        h, anchor_ids, embed_weight, w_in, w_state, w_out, norm_weight, lm_head_weight, eps,
        temperature=temperature, generator=generator, forced_ids=forced_ids,
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
