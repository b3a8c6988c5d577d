"""Checkpoint files at real shapes without their data, shared by tests."""

from __future__ import annotations

import json
import math
from pathlib import Path


def write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A valid bf16 safetensors file whose data region is a hole (sparse, reads as zeros): the header
    that names ``shapes``, then as many bytes as that data takes, none of them written."""
    offset, header = 0, {"__metadata__": {"format": "pt"}}
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        f.truncate(8 + len(blob) + offset)
