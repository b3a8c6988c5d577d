"""Starting real vLLM engines and servers from tests (CPU, in-process engine, loopback server)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from paths import REPO

# In-process engine core: no spawned worker, so tests can build LLM(...) without __main__ guards.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: Path, *args: str, timeout_s: float = 600, env: dict | None = None):
    """Run ``vllm serve MODEL ARGS`` (the project's ``.venv/bin/vllm``) on a loopback port.

    Yields the base URL; the server is stopped (SIGTERM, then SIGKILL) on exit. Its log is kept
    in ``server.log`` under a temp dir and printed if start-up fails.
    """
    port = free_port()
    vllm_bin = Path(sys.executable).parent / "vllm"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-server-{port}.log"
    cmd = [str(vllm_bin), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    server_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", **(env or {})}
    server_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=server_env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {timeout_s}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
