"""Checkpoint directories of :mod:`vllm_dlite.train` (exact resume). A checkpoint is
``<root>/step-<global step, 8 digits>/`` with ``trainer.pt`` (written by rank 0: whatever state
the trainer hands over; it holds the stage and data position, both models' unsharded weights, the
optimizer and scheduler, the config and the report so far) and one ``rng-rank<r>.pt`` per rank
(that rank's Python / NumPy / torch / CUDA RNG states and its metric window not logged yet);
``<root>/latest`` names the newest. :func:`write_checkpoint` is collective and atomic (a hidden
temporary directory renamed once every rank has written, older checkpoints pruned);
:func:`find_checkpoint` resolves ``run.resume`` and :func:`read_checkpoint` reads one back. What
the state holds, and the gathering of sharded tensors into it, stay with the trainer.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from vllm_dlite.train.distributed import DistInfo, barrier, full_state_options

STATE_FILE = "trainer.pt"
LATEST_FILE = "latest"


def _rank_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rng-rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_state(wrapped: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded optimizer state (rank 0 only gets the tensors); collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(wrapped, opt, options=full_state_options())


def restore_optimizer(wrapped, opt, sched, state) -> None:
    """Load the optimizer and scheduler of a ``trainer.pt`` state into ``opt`` / ``sched``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(wrapped, opt, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    sched.load_state_dict(state["scheduler"])


def write_checkpoint(root: Path, global_step: int, info: DistInfo, state: Optional[dict[str, Any]],
                     window: Optional[dict[str, Any]] = None, keep: int = 2) -> None:
    """Write ``root/step-<global_step>`` (collective: every rank calls it; ``state`` is used on
    rank 0 only) and point ``latest`` at it; keep the newest ``keep`` (at least 1)."""
    name = f"step-{global_step:08d}"
    final, tmp = root / name, root / f".{name}.tmp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    torch.save(dict(rng=rng_state(), window=window), _rank_file(tmp, info.rank))
    if info.is_main:
        torch.save(state, tmp / STATE_FILE)
    barrier(info)
    if info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / LATEST_FILE).write_text(name + "\n")
        keep = max(1, keep)
        old = sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    barrier(info)


def find_checkpoint(root: Path, resume: str) -> Optional[Path]:
    """``run.resume``: ``"none"`` -> None; ``"auto"`` -> the latest under ``root`` (None when there
    is none); anything else is the path of a checkpoint directory."""
    if resume == "none":
        return None
    if resume == "auto":
        latest = root / LATEST_FILE
        if not latest.is_file():
            return None
        return root / latest.read_text().strip()
    return Path(resume)


def read_checkpoint(path: Path, rank: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """``(state, per_rank)``: the ``trainer.pt`` state (CPU tensors) and this rank's
    ``{"rng", "window"}`` (None when the checkpoint has no file for this rank)."""
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    rank_file = _rank_file(path, rank)
    per_rank = torch.load(rank_file, weights_only=False) if rank_file.is_file() else None
    return state, per_rank


__all__ = [
    "find_checkpoint",
    "optimizer_state",
    "read_checkpoint",
    "restore_optimizer",
    "rng_state",
    "set_rng_state",
    "write_checkpoint",
]
