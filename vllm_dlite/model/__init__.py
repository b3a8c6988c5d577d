"""DLite in plain PyTorch (no vLLM import): the history-free drafter and the training teacher."""

from vllm_dlite.model.drafter import (
    CheckpointError,
    DLiteBase,
    DLiteDrafter,
    DraftOutput,
    check_weights_file,
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
    "check_weights_file",
    "load_drafter",
    "read_checkpoint_config",
]
