"""Offline batch generation with DLite in vLLM, against the same engine without speculation.

    .venv/bin/python examples/offline_generate.py            # shipped tiny target + DLite drafter

Replays assistant turns of held-out agentic sessions (prompts rendered with the target's chat
template, tools included), generates greedily without speculation, with DLite (fixed k), with
dlite-adaptive (per-request draft lengths from a measured cost model, the request's acceptance and
the head's confidence) and with dlite-hybrid (a suffix tree over the request's own context and
earlier outputs, where it is expected to beat DLite), and prints tau, the per-position acceptance, output
tokens/s, whether the outputs are identical (they must be: speculative decoding with vLLM's
rejection sampler is lossless) and, for the adaptive methods, which source proposed the accepted
tokens.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the lab (lab/: replay and server harness) lives at the root, not installed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("--methods", default=None,
                    help="comma-separated: none,dlite,dlite-adaptive,dlite-hybrid,ngram,eagle3,dflash (default: "
                         "none,dlite,dlite-adaptive,dlite-hybrid on v1; none,dlite on v2, which refuses the "
                         "adaptive methods)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    ap.add_argument("--max-num-seqs", type=int, default=4, help="concurrency inside the engine")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="shard the target over N workers (on CPU each rank is pinned to its own cores)")
    ap.add_argument("--runner", choices=("v1", "v2"), default="v1",
                    help="vLLM model runner (v2 on CPU runs through Triton's interpreter: slow, tiny models)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.methods is None:
        args.methods = "none,dlite,dlite-adaptive,dlite-hybrid" if args.runner == "v1" else "none,dlite"

    from transformers import AutoTokenizer

    from lab.harness.replay import RunResult, replay_in_fresh_process
    from vllm_dlite.train.workloads.replay import load_replay
    from vllm_dlite.vllm.engine import MethodUnavailable, speculative_config, use_cpu_env

    use_cpu_env(2, threads=1)  # one OpenMP thread: small CPU matmuls, spinning threads only contend

    tok = AutoTokenizer.from_pretrained(args.target)
    requests = load_replay(args.workload, tok, max_prompt_tokens=args.max_prompt_tokens)
    # Spread the picks over sessions and turns (short and long contexts alike).
    step = max(1, len(requests) // args.num_prompts)
    requests = requests[::step][: args.num_prompts]
    prompts = [r.prompt_token_ids for r in requests]
    print(f"{len(prompts)} replay prompts from {args.workload} "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens), "
          f"max {args.max_tokens} new tokens, greedy, K={args.num_speculative_tokens}, dtype {args.dtype}, "
          f"max_num_seqs {args.max_num_seqs}, tensor parallel {args.tensor_parallel_size}, device cpu")

    opts = dict(dtype=args.dtype, max_model_len=args.max_prompt_tokens + args.max_tokens + 64, seed=0,
                max_num_seqs=args.max_num_seqs, temperature=0.0, max_tokens=args.max_tokens,
                tensor_parallel_size=args.tensor_parallel_size, runner=args.runner)
    results, drafting, used = {}, {}, set()
    for method in args.methods.split(","):
        drafter = args.drafter if method.startswith("dlite") else None
        try:
            spec = speculative_config(method, args.num_speculative_tokens, drafter)
        except MethodUnavailable as exc:
            print(f"[{method}] unavailable: {exc}")
            continue
        # each engine in its own process; one warm-up request outside the timed replay
        res = replay_in_fresh_process(args.target, spec, prompts, opts)
        results[method] = RunResult(**res["summary"], outputs=res["outputs"])
        used.add(res["runner"])
        if res.get("drafting"):
            drafting[method] = res["drafting"]

    base = results.get("none")
    print(f"\nvLLM Model Runner {'/'.join(sorted(used)).upper() or '-'} (asked: {args.runner.upper()}), CPU")
    print(f"{'method':14} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'ITL ms':>8} {'KV pool':>10}  identical  per-position acceptance")
    for method, r in results.items():
        same = "-" if base is None or method == "none" else ("yes" if r.outputs == base.outputs else "NO")
        speed = f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x" if base else "-"
        tau = f"{r.tau:.2f}" if r.tau else "-"
        pos = " ".join(f"{p:.2f}" for p in r.tau_per_position)
        print(f"{method:14} {tau:>6} {r.output_tokens_per_s:8.1f} {speed:>8} {r.mean_itl_ms:8.1f} "
              f"{r.kv_pool_tokens:10,}  {same:9}  {pos}")
    for method, d in drafting.items():  # the proposer's own counters (its warm-up request included)
        t = d["totals"]
        print(f"{method}: accepted / proposed draft tokens: DLite {t['dlite']['accepted']} / "
              f"{t['dlite']['proposed']}, suffix tree {t['suffix']['accepted']} / {t['suffix']['proposed']}; "
              f"rounds {d['rounds']} {d['rounds_by_phase']}")
    if args.json:
        Path(args.json).write_text(json.dumps({m: r.summary() for m, r in results.items()}, indent=2))
    if base and any(m != "none" and r.outputs != base.outputs for m, r in results.items()):
        raise SystemExit("greedy outputs differ from the target's own: speculative decoding must be lossless")


if __name__ == "__main__":
    main()
