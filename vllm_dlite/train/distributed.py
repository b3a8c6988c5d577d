"""torch.distributed plumbing of :mod:`vllm_dlite.train`: the process group torchrun describes
(:func:`init_distributed`, gloo on CPU, nccl on GPU; a single process needs none), the rank's
:class:`DistInfo`, and what the stage loop does across ranks: :func:`barrier`, :func:`agree` (any
rank's flag), :func:`wait_for_file` (a wait on rank 0's file without a collective),
:func:`wrap_model` (DDP / FSDP2), :func:`no_sync` and :func:`full_model_state` (unsharded
weights). With ``world_size == 1`` the collectives are no-ops; otherwise every rank must make
them in the same order. Nothing here knows of stages or of the models trained.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_pref: str) -> DistInfo:
    """Init torch.distributed from torchrun's environment (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank, world, local_rank, device)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def wait_for_file(path: Path, newer_than: float = 0.0, poll_s: float = 2.0) -> None:
    """Non-main ranks wait (without a collective, which could time out during a long data
    regeneration) for rank 0 to (re)write ``path``. Rank 0 deletes a stale copy before rewriting
    it, so the file may vanish between two looks; that is waiting, not an error."""
    while True:
        try:
            if path.stat().st_mtime >= newer_than:
                return
        except FileNotFoundError:
            pass
        time.sleep(poll_s)

def agree(info: DistInfo, flag: bool) -> bool:
    """True when any rank says so (ranks must leave a stage at the same step)."""
    if not info.enabled:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def wrap_model(model: nn.Module, info: DistInfo, parallel: str) -> nn.Module:
    """``parallel`` ``"fsdp"``: FSDP2 (``fully_shard``); else DDP."""
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit: the teacher calls its layers' sub-modules directly (per-layer units
        # would not be gathered); parameters, gradients and optimizer states are sharded.
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [info.local_rank] if info.device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def no_sync(model: nn.Module):
    """Context without gradient synchronisation for a DDP or FSDP2 module (plain: a no-op)."""
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        @contextlib.contextmanager
        def fsdp_no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return fsdp_no_sync()
    return contextlib.nullcontext()


def full_state_options(all_ranks: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload: rank 0 only gets the tensors (on CPU); other ranks get an empty dict
    return StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)


def full_model_state(model: nn.Module, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded state dict of a plain, DDP or FSDP2 module (FQNs without wrappers).

    Collective under FSDP (every rank must call it). Default: CPU tensors on rank 0 only (for
    saving); ``all_ranks=True``: every rank gets the tensors on the model's device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=full_state_options(all_ranks))


__all__ = [
    "DistInfo",
    "agree",
    "barrier",
    "full_model_state",
    "full_state_options",
    "init_distributed",
    "no_sync",
    "wait_for_file",
    "wrap_model",
]
