"""Save and load DLite checkpoints in the authors' ``dlite_v1`` layout: the one loader.

A checkpoint is an HF-style directory (or a Hugging Face repo id): ``config.json``
(:meth:`vllm_dlite.config.DLiteConfig.to_checkpoint_config`) and the drafter's own tensors under
the authors' names (``layers.{i}.*``, ``norm``, ``context_norm``, ``layer_depth_embedding``,
``sequential_head.*``; nothing of the target), either in ``model.safetensors`` or sharded with a
``model.safetensors.index.json``. What the authors' files may hold that the spec leaves open is
tolerated: a key prefix common to every tensor (e.g. ``model.``), rotary ``inv_freq`` buffers,
any ``architectures`` string, bf16/fp16/fp32 storage.

* :func:`resolve_checkpoint_dir`: local path or hub id (through ``huggingface_hub``) -> directory.
* :func:`check_checkpoint`: config + safetensors headers only (no tensor data), cheap enough for
  vLLM's config time; ONE :class:`CheckpointError` naming the file, every problem and the fix.
* :func:`load_drafter`: the loader used by training, tests and vLLM.
* :func:`save_pretrained`: writes config.json + model.safetensors (bf16 by default, as released).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Optional, Union

import torch

from vllm_dlite.config import DLiteConfig, authors_defaults_taken
from vllm_dlite.model.drafter import DLiteDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_DTYPES = ("F32", "F16", "BF16")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FIX = "copy the checkpoint again or re-export it with save_pretrained"
# Qwen3 keys that decide tensor shapes (a wrong default shows up as a shape mismatch)
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "num_hidden_layers", "attention_bias")

PathLike = Union[str, Path]


class CheckpointError(ValueError):
    """A DLite checkpoint exists but is malformed (the message names the file and the fix)."""


# =========================================================================== locate
def resolve_checkpoint_dir(model: PathLike, revision: Optional[str] = None) -> Path:
    """A local directory for ``model``: a path, or a Hugging Face repo id (local cache or
    download: config.json and the safetensors files only). ``FileNotFoundError`` naming the fix."""
    path = Path(os.path.expanduser(str(model)))
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"a DLite checkpoint is a directory holding {CONFIG_FILE} and "
                                     f"{WEIGHTS_FILE}, got a file: {path}")
        return path
    text = str(model)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, revision=revision,
                                          allow_patterns=[CONFIG_FILE, "*.safetensors", INDEX_FILE]))
        except Exception as exc:  # noqa: BLE001 - the cause goes into the message
            raise FileNotFoundError(
                f"DLite checkpoint '{model}' is neither a local directory nor a downloadable Hugging "
                f"Face repo ({type(exc).__name__}: {exc}); download it first (huggingface-cli "
                "download) and pass the directory as speculative_config['model']") from None
    raise FileNotFoundError(f"DLite checkpoint directory not found: {path}; pass the checkpoint "
                            "directory (or a Hugging Face repo id) as speculative_config['model']")


def read_checkpoint_config(directory: PathLike) -> tuple[dict[str, Any], DLiteConfig]:
    """``(config.json dict, DLiteConfig)`` of a checkpoint directory; errors name the file."""
    config_file = Path(directory) / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: a DLite checkpoint directory holds "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE} (or sharded safetensors + {INDEX_FILE})")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc}); {_FIX}") from None
    try:
        return cfg, DLiteConfig.from_checkpoint_config(cfg)
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: {exc}") from None


def weight_files(directory: PathLike) -> list[Path]:
    """The checkpoint's safetensors files: ``model.safetensors`` or the shards of the index."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({exc!r}); {_FIX}") from None
        files = [directory / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(
                f"{directory} is incomplete: {INDEX_FILE} maps tensors to {len(files)} shard(s) and "
                f"{absent} {'is' if len(absent) == 1 else 'are'} missing; download the checkpoint "
                "again (every *.safetensors file the index names) or re-export it with save_pretrained")
    else:
        files = [directory / WEIGHTS_FILE]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: {_FIX}")
    return files


# =========================================================================== check (headers only)
def _read_header(file: Path) -> dict[str, Any]:
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(fh.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read as safetensors ({exc}); {_FIX}") from None
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if size != 8 + n + end:
        raise CheckpointError(f"{file} is truncated or padded: {size} bytes, its header describes "
                              f"{8 + n + end}; {_FIX}")
    return header


def expected_shapes(config: DLiteConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a drafter with this config (built on the meta device)."""
    with torch.device("meta"):
        model = DLiteDrafter(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _key_map(keys: list[str], expected: set[str]) -> tuple[dict[str, str], list[str]]:
    """Map stored keys to drafter names, stripping one prefix common to all of them if the keys
    carry one. Returns ``(stored -> name, ignored keys)``."""
    ignored = [k for k in keys if k.endswith(_IGNORED_SUFFIXES)]
    keys = [k for k in keys if k not in ignored]
    prefix = ""
    if keys and not any(k in expected for k in keys):
        for name in sorted(expected, key=len, reverse=True):
            hits = [k for k in keys if k.endswith("." + name)]
            if hits:
                prefix = hits[0][: -len(name)]
                break
        if prefix and not all(k.startswith(prefix) for k in keys):
            prefix = ""
    return {k: k[len(prefix):] for k in keys}, ignored


def check_checkpoint(directory: PathLike,
                     parsed: Optional[tuple[dict[str, Any], DLiteConfig]] = None) -> DLiteConfig:
    """Check config.json and every safetensors header against each other WITHOUT reading tensor
    data: complete files, every tensor present with its shape, none unexpected, float dtypes.
    ``parsed``: what :func:`read_checkpoint_config` already returned (config.json is not read
    again). Raises one :class:`CheckpointError` naming the file(s), every problem and the fix."""
    raw, config = parsed or read_checkpoint_config(directory)
    expected = expected_shapes(config)
    stored: dict[str, tuple[Path, dict]] = {}
    files = weight_files(directory)
    for file in files:
        for key, meta in _read_header(file).items():
            stored[key] = (file, meta)
    names, _ = _key_map(list(stored), set(expected))
    problems = []
    by_name = {name: stored[key] for key, name in names.items()}
    missing = sorted(set(expected) - set(by_name))
    unexpected = sorted(k for k, n in names.items() if n not in expected)
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    for name in sorted(set(expected) & set(by_name)):
        shape, dtype = tuple(by_name[name][1]["shape"]), by_name[name][1]["dtype"]
        if shape != expected[name]:
            problems.append(f"tensor '{name}' has shape {shape}, config.json implies {expected[name]}")
        if dtype not in _WEIGHT_DTYPES:
            problems.append(f"tensor '{name}' has dtype {dtype}, expected one of {list(_WEIGHT_DTYPES)}")
    if problems:
        taken = {k: v for k, v in authors_defaults_taken(raw).items() if k in _SHAPE_KEYS}
        if taken:  # a left-out key means the authors' default, which the tensors may contradict
            problems.append(f"config.json leaves out {sorted(taken)}, which the authors' code "
                            f"(transformers 4.57 Qwen3Config) takes as {taken}: add the keys the "
                            "drafter was trained with")
        raise CheckpointError(f"{', '.join(map(str, files))} do not match {Path(directory) / CONFIG_FILE}: "
                              + "; ".join(problems) + f"; {_FIX}")
    return config


# =========================================================================== load / save
def load_drafter(path: PathLike, device: Union[str, torch.device] = "cpu",
                 dtype: Optional[torch.dtype] = None, revision: Optional[str] = None,
                 config: Optional[DLiteConfig] = None) -> DLiteDrafter:
    """The one loader: checkpoint directory or hub id -> :class:`DLiteDrafter` (eval mode).
    ``dtype=None`` keeps the stored dtype. ``config``: the checkpoint's config, already checked
    (:func:`check_checkpoint`; vLLM's workers get it from the config step), so config.json is not
    read again. Call ``bind_target`` next."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = resolve_checkpoint_dir(path, revision)
    config = config or check_checkpoint(directory)
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        try:
            tensors.update(load_file(str(file), device=str(device)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file} cannot be read as safetensors ({exc}); {_FIX}") from None
    names, _ = _key_map(list(tensors), set(expected_shapes(config)))
    state = {name: tensors[key] for key, name in names.items()}
    with torch.device("meta"):
        model = DLiteDrafter(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.layer_ids = torch.tensor(config.target_layer_ids, device=device)  # non-persistent buffer
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


def save_pretrained(model: DLiteDrafter, directory: PathLike,
                    target_hf_config: Optional[dict[str, Any]] = None,
                    dtype: Optional[torch.dtype] = torch.bfloat16) -> Path:
    """Write ``config.json`` (authors' layout, built on ``target_hf_config`` when given) and
    ``model.safetensors`` (the drafter's tensors, in ``dtype``; None keeps the model's)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    cfg = model.config.to_checkpoint_config(target_hf_config, torch_dtype=str(dtype).removeprefix("torch."))
    (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "check_checkpoint",
    "expected_shapes",
    "load_drafter",
    "read_checkpoint_config",
    "resolve_checkpoint_dir",
    "save_pretrained",
    "weight_files",
]
