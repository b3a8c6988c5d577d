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
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the lab (lab/: replay and server harness) lives at the root, not installed


def spec_decode_counters(server) -> dict[str, float]:
    """``vllm:spec_decode_*`` samples of ``/metrics``, summed over label sets."""
    return {k: v for k, v in server.metrics().items() if k.startswith("vllm:spec_decode")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("-k", "--k", "--num-speculative-tokens", dest="k", type=int, default=None,
                    help="draft tokens per round (default: the --drafter's K)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="shard the target over N workers (on CPU each rank gets its own cores)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip vLLM's model compilation: a faster start-up, the same tokens")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", help="also write the reply and the spec-decode counters here")
    args = ap.parse_args()
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, args.drafter)  # default: the drafter's own K

    from openai import OpenAI

    from lab.harness.server import ServerStartError, VLLMServer
    from vllm_dlite.train.workloads.schema import read_sessions
    from vllm_dlite.vllm.engine import cpu_env, tensor_parallel_env

    session = next(read_sessions(args.workload))
    turn = next(i for i, m in enumerate(session["messages"]) if m["role"] == "assistant")
    messages, tools = session["messages"][:turn], session["tools"]

    spec = {"method": "dlite", "model": args.drafter, "num_speculative_tokens": args.k}
    flags = ["--dtype", "float32", "--max-model-len", "16384", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--speculative-config", json.dumps(spec)]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    env = cpu_env(2, environ=os.environ)
    if args.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        env.update(tensor_parallel_env(args.tensor_parallel_size))  # CPU: one core group per rank
    server = VLLMServer(args.target, *flags, env=env, timeout_s=args.timeout_s)
    print("+", " ".join(server.command[:-1]), f"'{server.command[-1]}'", flush=True)
    try:
        server.start()
    except ServerStartError as exc:
        sys.exit(str(exc))
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
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
        counters = spec_decode_counters(server)
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
                spec_decode=counters, command=server.command), indent=2) + "\n")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
