"""``vllm serve`` as a child process on a loopback port: start, wait until healthy, measure, stop.

Used by the load/fault benchmark, the session replay and the tests, so every one of them starts the
server the same way (the project's ``.venv/bin/vllm``, the user's flags unchanged).

* :class:`VLLMServer` is a context manager: ``with VLLMServer(model, *flags) as server:`` yields
  once ``/health`` answers 200; its ``base_url``, ``pid``, ``log_path``; :meth:`rss_bytes` (resident
  memory of the server's whole process tree: API server, engine core, workers); the process group is
  stopped on exit (SIGTERM, then SIGKILL after 30 s).
* A server that exits or never becomes healthy raises :class:`ServerStartError` with the end of its
  log (the user's error, e.g. a bad ``--speculative-config``, is in it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional


class ServerStartError(RuntimeError):
    """``vllm serve`` exited or did not become healthy; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, returncode: Optional[int], log_tail: str):
        super().__init__(f"{message}; end of its log:\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text (vLLM's ``/metrics``) as ``{name: value}``, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                pass
    return out


class VLLMServer:
    def __init__(self, model: str | Path, *flags: str, env: Optional[dict] = None, timeout_s: float = 600,
                 log_path: Optional[Path] = None, cwd: Optional[Path] = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [str(Path(sys.executable).parent / "vllm"), "serve", str(model),
                        "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.env = {**os.environ, **(env or {})}
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core apart
        self.timeout_s = timeout_s
        self.log_path = Path(log_path or Path(tempfile.gettempdir()) / f"vllm-serve-{self.port}.log")
        self.cwd = cwd
        self.proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> "VLLMServer":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, start_new_session=True)
        deadline = time.time() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"vllm serve exited with {self.proc.returncode}", self.proc.returncode,
                                       self.log_tail())
            if self.healthy():
                return self
            if time.time() > deadline:
                self.stop()
                raise ServerStartError(f"vllm serve not healthy after {self.timeout_s:.0f} s", None, self.log_tail())
            time.sleep(1)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the server process and all its descendants."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def metrics(self) -> dict[str, float]:
        """``/metrics`` (Prometheus text) as ``{name: value}``, summed over label sets."""
        return parse_metrics(urllib.request.urlopen(self.base_url + "/metrics", timeout=10).read().decode())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["ServerStartError", "VLLMServer", "free_port"]
