"""DLite in plain PyTorch (no vLLM import): the history-free drafter and the training teacher."""

from vllm_dlite.model.drafter import (
    CheckpointError,
    DLiteBase,
    DLiteDrafter,
    DraftOutput,
    load_drafter,
    read_checkpoint_config,
)
from vllm_dlite.model.teacher import HistoryTeacher

__all__ = [
    "CheckpointError",
    "DLiteBase",
    "DLiteDrafter",
    "DraftOutput",
    "HistoryTeacher",
    "load_drafter",
    "read_checkpoint_config",
]
