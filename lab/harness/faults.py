"""Damaged drafter checkpoints, the ways ``model.safetensors`` gets broken in practice (an
interrupted copy, a stale export, a bad conversion). The config-time checkpoint check
(:func:`vllm_dlite.model.checkpoint.check_checkpoint`) must name each one; the tests and
``benchmarks/serve_load.py`` build their cases here."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_FAULTS = ("truncated", "missing_tensor", "wrong_dtype", "wrong_shape")


def damage_weights(path: str | Path, how: str, tensor: str | None = None) -> str | None:
    """Damage the safetensors file ``path`` in place; returns the tensor it changed (``tensor``,
    by default the first by name), ``None`` for ``truncated`` (the file loses its last third)."""
    import torch
    from safetensors.torch import load_file, save_file

    if how not in CHECKPOINT_FAULTS:
        raise ValueError(f"unknown checkpoint fault {how!r}; choose one of {CHECKPOINT_FAULTS}")
    path = Path(path)
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
        return None
    tensors = load_file(str(path))
    name = tensor or sorted(tensors)[0]
    if how == "missing_tensor":
        tensors.pop(name)
    elif how == "wrong_dtype":
        tensors[name] = tensors[name].to(torch.int32)
    else:  # wrong_shape: flattened, one element short
        tensors[name] = tensors[name].reshape(-1)[:-1].clone()
    save_file(tensors, str(path))
    return name
