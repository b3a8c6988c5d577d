"""DLite (format ``dlite_v1``) in plain PyTorch, no vLLM import: the drafter and its checkpoints.
The training teacher lives in :mod:`vllm_dlite.model.teacher` (training only)."""

from vllm_dlite.model.checkpoint import (
    CheckpointError,
    check_checkpoint,
    load_drafter,
    read_checkpoint_config,
    resolve_checkpoint_dir,
    save_pretrained,
)
from vllm_dlite.model.drafter import DLiteDrafter, DraftOutput, anchor_group

__all__ = [
    "CheckpointError",
    "DLiteDrafter",
    "DraftOutput",
    "anchor_group",
    "check_checkpoint",
    "load_drafter",
    "read_checkpoint_config",
    "resolve_checkpoint_dir",
    "save_pretrained",
]
