"""Starting real vLLM engines and servers from tests (CPU, in-process engine, loopback server)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from paths import REPO

from vllm_dlite.vllm.engine import cpu_env, use_cpu_env

# In-process engine core: no spawned worker, so tests can build LLM(...) without __main__ guards.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
use_cpu_env(1)  # GiB: ~87k tokens of the shipped target


def vllm_server_process(model: Path, *args: str, timeout_s: float = 600, env: dict | None = None):
    """``vllm serve MODEL ARGS`` on a loopback port, not started yet (``lab.harness.server.VLLMServer``:
    ``start()`` waits until healthy, start-up failures raise with the log's end; ``stop()``)."""
    from lab.harness.server import VLLMServer

    return VLLMServer(model, *args, env={**cpu_env(1), **(env or {})}, timeout_s=timeout_s, cwd=REPO)


@contextlib.contextmanager
def vllm_server(model: Path, *args: str, timeout_s: float = 600, env: dict | None = None):
    """Run ``vllm serve MODEL ARGS`` (:func:`vllm_server_process`); yields the base URL, stops the
    server on exit; start-up failures raise with the log's end."""
    with vllm_server_process(model, *args, timeout_s=timeout_s, env=env) as server:
        yield server.base_url
