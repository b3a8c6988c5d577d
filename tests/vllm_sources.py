"""Where the fetched vLLM release sources are (``scripts/fetch_vllm_sources.sh``), for the static
compat tests. No vLLM is imported from them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
FETCH = "bash scripts/fetch_vllm_sources.sh"


def cache_dir() -> Path:
    return Path(os.environ.get("DLITE_VLLM_SOURCES", REPO / ".vllm-sources"))


def source_root(version: str) -> Path:
    """``.vllm-sources/<version>`` (holding ``vllm/``), or skip naming the fetch command."""
    root = cache_dir() / version
    if not (root / ".complete").is_file():
        pytest.skip(f"vLLM {version} sources not fetched: run `{FETCH}` (about 15 s, ~850 MB download, "
                    f"~170 MB kept in {cache_dir()})")
    return root
