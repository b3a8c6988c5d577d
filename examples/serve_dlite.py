"""Serve the tiny target with DLite behind vLLM's OpenAI-compatible server, send one agent turn.

    .venv/bin/python examples/serve_dlite.py          # shipped tiny target + DLite drafter, K = 7

Equivalent to running, in another shell::

    .venv/bin/vllm serve models/qwen3-tiny-stdlib --dtype float32 \\
        --enable-auto-tool-choice --tool-call-parser hermes \\
        --speculative-config '{"method": "dlite", "model": "models/dlite-qwen3-tiny-stdlib",
                               "num_speculative_tokens": 7}'

then one chat completion with the agent's tools (the first turn of a held-out agentic session)
through the ``openai`` client, and the spec-decode lines of ``/metrics``. Loopback only; the server
is stopped on exit. ``--json PATH`` also writes the reply and the counters.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            sys.exit(f"vllm serve exited with {proc.returncode}; its log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            sys.exit(f"vllm serve not healthy after {timeout_s:.0f} s; its log:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def spec_decode_counters(base: str) -> dict[str, float]:
    """``vllm:spec_decode_*`` samples of ``/metrics`` (Prometheus text), summed over label sets."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            counters[name] = counters.get(name, 0.0) + value
    return counters


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="shard the target over N workers (on CPU each rank gets its own cores)")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", help="also write the reply and the spec-decode counters here")
    args = ap.parse_args()

    from openai import OpenAI

    from vllm_dlite.workloads.schema import read_sessions

    session = next(read_sessions(args.workload))
    turn = next(i for i, m in enumerate(session["messages"]) if m["role"] == "assistant")
    messages, tools = session["messages"][:turn], session["tools"]

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    spec = {"method": "dlite", "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", args.target, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "16384",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--speculative-config", json.dumps(spec)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}
    if args.tensor_parallel_size > 1:
        from vllm_dlite.vllm.replay_engine import cpu_thread_binding

        cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        if not _has_cuda():  # vLLM's CPU workers need one core group per rank
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(args.tensor_parallel_size)
    print("+", " ".join(cmd[:-1]), f"'{cmd[-1]}'", flush=True)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dlite-serve-{port}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(base, proc, log, args.timeout_s)
        client = OpenAI(base_url=base + "/v1", api_key="none")
        t0 = time.time()
        resp = client.chat.completions.create(model=args.target, messages=messages, tools=tools,
                                              temperature=0, max_tokens=args.max_tokens)
        wall = time.time() - t0
        msg = resp.choices[0].message
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
        print(f"\nuser: {messages[-1]['content'][:200]}")
        print(f"assistant: {msg.content!r}\ntool calls: {calls}")
        print(f"{resp.usage.prompt_tokens} prompt tokens, {resp.usage.completion_tokens} completion tokens, "
              f"{wall:.2f} s")
        counters = spec_decode_counters(base)
        print("\n/metrics (spec decode):")
        for name, value in sorted(counters.items()):
            print(f"  {name} {value:g}")
        drafts, accepted = counters.get("vllm:spec_decode_num_drafts_total", 0), \
            counters.get("vllm:spec_decode_num_accepted_tokens_total", 0)
        if drafts:
            print(f"  -> tau (accepted per draft + 1) = {1 + accepted / drafts:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                content=msg.content, tool_calls=calls, usage=resp.usage.model_dump(), wall_s=wall,
                spec_decode=counters, command=cmd), indent=2) + "\n")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
