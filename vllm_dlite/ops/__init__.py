"""DLite ops: ``draft_attention`` and the sequential head.

Call sites use ``from vllm_dlite import ops; ops.draft_attention(...)`` (attribute look-up at call
time), so a dispatcher that picks a CUDA kernel when one is built can rebind these names here
without touching the model code. Today every name is the PyTorch reference in
:mod:`vllm_dlite.ops.reference`, which is also the specification the kernel must match.
"""

from vllm_dlite.ops.reference import (
    apply_rope,
    draft_attention,
    rope_cos_sin,
    rotate_half,
    sequential_head,
    sequential_head_teacher_forced,
)

__all__ = [
    "apply_rope",
    "draft_attention",
    "rope_cos_sin",
    "rotate_half",
    "sequential_head",
    "sequential_head_teacher_forced",
]
