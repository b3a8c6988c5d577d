"""DLite ops: ``draft_attention`` and the sequential head.

Call sites use ``from vllm_dlite import ops; ops.draft_attention(...)`` (attribute look-up at call
time), so a dispatcher that picks a CUDA kernel when one is built can rebind these names here
without touching the model code. ``draft_attention`` and ``sequential_head`` are dispatched
(:mod:`vllm_dlite.ops.dispatch`): the CUDA op from the optional ``vllm_dlite._C`` extension for
supported CUDA inputs, else the PyTorch reference in :mod:`vllm_dlite.ops.reference`, which is also
the specification the kernels must match; ``backend_report()`` says which path is used and why.
The other names are the reference.
"""

from vllm_dlite.ops.reference import (
    apply_rope,
    rope_cos_sin,
    rotate_half,
    sequential_head_teacher_forced,
)
from vllm_dlite.ops.dispatch import backend_report, draft_attention, sequential_head

__all__ = [
    "apply_rope",
    "backend_report",
    "draft_attention",
    "rope_cos_sin",
    "rotate_half",
    "sequential_head",
    "sequential_head_teacher_forced",
]
