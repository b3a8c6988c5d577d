#!/usr/bin/env python3
"""A/B benchmark: speculative methods on one target, identical engine settings, replayed sessions.

    .venv/bin/python benchmarks/ab.py --workload benchmarks/workloads/heldout_agentic.jsonl \\
        --methods none,ngram,suffix,eagle3,dflash,dlite --out results/ab-agentic

Contract:
* every assistant turn of every session in ``--workload`` (any file in the docs/design.md §6
  format) becomes one request, its prompt rendered with the target's chat template and tools
  (``vllm_dlite.train.workloads.replay``); ``--max-requests N`` keeps N of them spread evenly over the
  file (for slow machines; the default keeps all);
* ``NAME@k`` in ``--methods`` is that method with ``k <= -k`` tokens per round (``dlite@3``), so that
  several k compare in one run;
* ``--runner v1|v2``: vLLM's model runner (V2 on CPU through Triton's interpreter,
  ``lab.harness.runners``; the engine's real runner is checked and recorded in the settings);
* each method runs in a FRESH vLLM engine, in a fresh process, per concurrency level
  (``max_num_seqs`` = 1, 4, 16 by default) with the same K, temperature, max tokens, dtype, seed
  and max model length;
* terms (vLLM's): ``tau`` = 1 + accepted / drafts (tokens per target verification, bonus
  included); ``tau_per_position[i]`` = share of drafts whose position i was accepted;
  ``output_tokens_per_s`` = generated tokens / wall time of the replay; ``mean_itl_ms`` = mean over
  requests of (last - first token time) / (tokens - 1); ``kv_pool_tokens`` = the target's KV pool;
* draft cost against context length: every draft round is timed inside vLLM's model runner
  (``DraftTimer``: the whole runner call and the drafter's own ``propose``); the steady-state
  rounds (after a verification) of the concurrency-1 run are grouped by the request's context
  length (nearest of 1k / 4k / 16k tokens on a log scale) and the medians are reported (rounds
  after a prefill chunk separately, the whole runner call and the drafter's own ``propose``: there
  vLLM's runner first concatenates the whole chunk's aux hidden states);
* tau against prompt length (``tau_by_prompt_tokens``, from the lowest concurrency's run): the
  requests are grouped by prompt length into EXACTLY the buckets ``"0-2k"`` [0, 2048),
  ``"2k-8k"`` [2048, 8192) and ``"8k-32k"`` [8192, 32768) tokens; per bucket the request, draft,
  draft-token and accepted counts, ``tau`` = 1 + accepted / drafts and ``tau_per_position``, all
  from vLLM's per-request acceptance histograms (``RequestOutput.outputs[0].spec_decode_metrics``:
  ``hist[j]`` = verify steps with j accepted draft tokens; drafts = sum(hist), accepted =
  sum(j * hist[j]), position i accepted in sum_{j>i} hist[j] drafts); ``per_request_tau`` keeps
  ``[prompt_tokens, drafts, accepted]`` per request for the scatter plot, and
  ``per_request_matches_counters`` says whether those add up to the engine's own counters;
* ``--max-prompt-tokens`` may go up to the target's context: max model len = max prompt tokens +
  max tokens + K + 8 must be <= the target's ``max_position_embeddings`` (on the tiny target,
  32,768: ``--max-prompt-tokens 30000`` gives 30,079), else the run stops before any engine starts;
* ``--repeats N`` measures every (method, concurrency) cell N times, methods interleaved (one pass
  over all methods, then the next), each time in a fresh engine: tok/s, ITL and wall are the
  medians, ``by_concurrency[c]["repeats"]`` keeps every run's values and ``results.md`` shows
  ``median (min-max)``; tau, histograms and draft times are the first pass's;
* at temperature 0 every method's outputs, in every pass, must equal ``none``'s (``identical_to_none``);
* a method that cannot run here (no drafter checkpoint, missing package) is reported with the
  reason in ``results.json`` and the table, never silently dropped.

Writes ``OUT/results.json``, ``OUT/results.md`` and, with matplotlib, ``OUT/tau_per_position.png``,
``OUT/tokens_per_s_vs_concurrency.png``, ``OUT/draft_ms_vs_context.png``,
``OUT/tau_by_prompt_tokens.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # DraftTimer needs the in-process engine

from lab.buckets import PROMPT_BUCKETS  # noqa: E402  (after the path)
from repeats import combine_passes, spread  # noqa: E402  (beside this script)
from lab.harness.runners import default_runner  # noqa: E402
from vllm_dlite.vllm.engine import use_cpu_env  # noqa: E402  (after the path)

use_cpu_env(4, threads=1)  # GiB: prompts to 30k tokens fit

CONTEXT_BUCKETS = (1024, 4096, 16384)
MODEL_LEN_MARGIN = 8  # max model len = max prompt tokens + max tokens + K + this
# --compile (CUDA only): "vllm" = vLLM's default (torch.compile + FULL_AND_PIECEWISE CUDA graphs); "none" =
# no torch.compile, full CUDA graphs of the uniform decode/verify steps only (an engine starts in seconds)
COMPILE_MODES = {"vllm": None, "none": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


def engine_kwargs(compile_mode: str = "vllm", gpu_memory_utilization: float | None = None) -> dict:
    """Extra ``LLM`` arguments of a GPU run: the CUDA-graph settings of ``compile_mode``
    (:data:`COMPILE_MODES`) and the share of GPU memory; none on CPU (eager there)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    kw: dict = {}
    if COMPILE_MODES[compile_mode] is not None:
        kw["compilation_config"] = dict(COMPILE_MODES[compile_mode])
    if gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = gpu_memory_utilization
    return kw


def parse_method(name: str) -> tuple[str, int | None]:
    """``method`` or ``method@k``: the same method with ``k`` speculative tokens per round instead of
    ``-k`` (``dlite@3``: fixed-k DLite drafting 3 of its K), so that several k compare in one run."""
    method, _, k = name.partition("@")
    return method, (int(k) if k else None)


def drafter_family(name: str) -> str:
    """Whose checkpoint a method reads: ``dlite@3`` -> ``dlite``."""
    return parse_method(name)[0]


def default_drafter(method: str) -> Path:
    return REPO / "models" / f"{method}-qwen3-tiny-stdlib"


def context_bucket(tokens: int) -> int:
    return min(CONTEXT_BUCKETS, key=lambda b: abs(math.log(max(tokens, 1) / b)))


def tau_by_prompt_tokens(records: list[dict]) -> dict:
    """Acceptance per prompt-length bucket from per-request records ``{"prompt_tokens", "histogram",
    "draft_tokens"}`` (``lab.harness.replay.request_spec_record``; ``histogram[j]`` = verify steps with
    exactly j accepted draft tokens, empty without speculation). Every bucket is present; one
    without drafts has ``tau`` None and no per-position figures."""
    out = {}
    for name, lo, hi in PROMPT_BUCKETS:
        recs = [r for r in records if lo <= r["prompt_tokens"] < hi]
        hists = [r["histogram"] for r in recs if r["histogram"]]
        drafts = sum(sum(h) for h in hists)
        accepted = sum(j * c for h in hists for j, c in enumerate(h))
        width = max((len(h) for h in hists), default=1) - 1  # K (the histogram runs 0..K)
        out[name] = {
            "requests": len(recs), "drafts": drafts, "draft_tokens": sum(r["draft_tokens"] for r in recs),
            "accepted": accepted, "tau": 1 + accepted / drafts if drafts else None,
            "tau_per_position": [sum(c for h in hists for c in h[i + 1:]) / drafts for i in range(width)]
            if drafts else [],
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in recs) / len(recs) if recs else None,
        }
    return out


def per_request_rounds(draft_rounds: list) -> list[list[list[int]]]:
    """Concurrency 1, V1: per request (in the order the engine ran them), its verifications in
    order, each ``[drafted, accepted]`` (draft tokens the step verified, how many of them were
    accepted; ``[0, 0]``: a decoding step without drafts), from ``DraftTimer``'s rounds: a round
    that follows a decoding step records it. The reply grows by ``accepted + 1`` per step, from the
    one token of the prefill."""
    out: dict[str, list[list[int]]] = {}
    for d in draft_rounds:
        if len(d) < 8 or not d[6]:
            return []  # V2, or records from before DraftRound had these fields
        rounds = out.setdefault(d[6][0], [])
        if d[4]:
            rounds.append([d[7][0], d[5][0] - 1])
    return list(out.values())


def per_request_tau(records: list[dict]) -> list[list[int]]:
    """``[prompt_tokens, drafts, accepted]`` per request (the scatter in ``tau_by_prompt_tokens.png``)."""
    return [[r["prompt_tokens"], sum(r["histogram"]), sum(j * c for j, c in enumerate(r["histogram"]))]
            for r in records]


def target_context(target: str) -> int | None:
    """The target's ``max_position_embeddings`` (None when its config has none)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target)
    cfg = getattr(cfg, "text_config", None) or cfg
    return getattr(cfg, "max_position_embeddings", None)


def run_method(args, method: str, prompts: list[list[int]], drafter: str | None) -> dict:
    """Every concurrency level in a fresh engine in a fresh process: nothing (compiled kernels,
    patched modules, allocator state) carries over from one method to the next."""
    from vllm_dlite.vllm.engine import MethodUnavailable, speculative_config
    from lab.harness.replay import replay_in_fresh_process

    base, k = parse_method(method)
    try:
        spec = speculative_config(base, k or args.k, drafter)
    except MethodUnavailable as exc:
        return {"status": "unavailable", "reason": str(exc)}
    per_concurrency, draft_rounds, request_spec = {}, [], []
    for c in args.concurrency:
        opts = dict(dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed, max_num_seqs=c,
                    temperature=args.temperature, max_tokens=args.max_tokens,
                    tensor_parallel_size=args.tensor_parallel_size, runner=args.runner, k=k or args.k,
                    engine=engine_kwargs(getattr(args, "compile", "vllm")))
        try:
            res = replay_in_fresh_process(args.target, spec, prompts, opts)
            if res["runner"] != args.runner:
                raise RuntimeError(f"--runner {args.runner}: the engine used Model Runner {res['runner']}")
        except Exception as exc:  # noqa: BLE001 - reported in the results, not swallowed
            traceback.print_exc()
            print(f"[{method}] failed at concurrency {c}: {exc!r}", flush=True)
            return {"status": "failed", "reason": f"concurrency {c}: {exc!r}"}
        per_concurrency[c] = res
        if c == min(args.concurrency):  # DraftRound tuples: seconds, drafter_seconds, n, context, verifying
            draft_rounds = [d for d in res["draft_rounds"] if d[2] == 1] or list(res["draft_rounds"])
            request_spec = res.get("request_spec") or []
        r = res["summary"]
        print(f"[{method}] concurrency {c}: tau {r['tau'] if r['tau'] is None else round(r['tau'], 3)}, "
              f"{r['output_tokens_per_s']:.1f} tok/s, ITL {r['mean_itl_ms']:.1f} ms, {r['wall_s']:.0f} s",
              flush=True)
    first = per_concurrency[min(args.concurrency)]["summary"]
    draft_ms = {}
    for b in CONTEXT_BUCKETS:
        rounds = [d for d in draft_rounds if d[3] and context_bucket(d[3]) == b]  # V2 rounds: context 0
        steady = [d for d in rounds if d[4]]  # rounds after a verification (decode)
        if steady:
            draft_ms[str(b)] = {
                "median_ms": 1000 * statistics.median(d[0] for d in steady),
                "drafter_median_ms": 1000 * statistics.median(d[1] for d in steady),
                "rounds": len(steady),
                "after_prefill_median_ms": 1000 * statistics.median(d[0] for d in rounds if not d[4])
                if len(steady) < len(rounds) else None,
                "after_prefill_drafter_median_ms": 1000 * statistics.median(d[1] for d in rounds if not d[4])
                if len(steady) < len(rounds) else None,
                "after_prefill_rounds": len(rounds) - len(steady),
            }
    points = per_request_tau(request_spec)
    rounds = per_request_rounds(draft_rounds) if min(args.concurrency) == 1 else []
    return {
        "status": "ok", **{k: v for k, v in first.items() if k != "method"},
        "by_concurrency": {str(c): {k: res["summary"][k] for k in ("tau", "output_tokens_per_s", "mean_itl_ms",
                                                                     "wall_s", "output_tokens")}
                           for c, res in per_concurrency.items()},
        "draft_ms_by_context": draft_ms,
        "tau_by_prompt_tokens": tau_by_prompt_tokens(request_spec),
        # the per-request histograms add up to the engine's counters (same drafts and accepted tokens)
        "per_request_matches_counters": [sum(p[1] for p in points), sum(p[2] for p in points)]
        == [first["num_drafts"], first["accepted_tokens"]],
        "per_request_tau": points,
        # concurrency 1, V1: each request's verifications in order, [drafted, accepted]
        **({"per_request_rounds": rounds,
            "per_request_rounds_match_histograms": [[sum(d > 0 for d, _ in r), sum(a for _, a in r)]
                                                    for r in rounds] == [p[1:] for p in points]}
           if rounds else {}),
        "_outputs": {c: res["outputs"] for c, res in per_concurrency.items()},
    }


def run_levels(target: str, method: str, prompts: list[list[int]], levels: list, opts: dict, *,
               drafter: str | None = None, fresh: bool = True) -> dict:
    """``method`` in ONE engine (``max_num_seqs`` = the largest batch) over several levels: ``levels`` =
    ``[(label, batch, prompt indices)]``, each level's prompts submitted ``batch`` at a time
    (``lab.harness.replay.replay_once``), for a GPU run that cannot afford an engine per concurrency
    (``benchmarks/gpu_check.py``, stage c). ``opts`` as :func:`run_method`'s (dtype, max_model_len,
    seed, temperature, max_tokens, runner, engine); ``fresh=False`` builds the engine in this process
    (set up for ``opts["runner"]``). Returns ``{status, reason}`` when the method cannot run, else
    ``{status: "ok", runner, levels: {label: {tau, output_tokens_per_s, mean_itl_ms, ..., draft_round_ms,
    draft_rounds, outputs}}}``; ``draft_round_ms`` is the median of the steady rounds (after a
    verification) as timed by the engine's draft timer (CUDA events on V2, ``DraftTimer`` on V1)."""
    from vllm_dlite.vllm.engine import MethodUnavailable, speculative_config
    from lab.harness.replay import replay_in_fresh_process, replay_once

    base, k = parse_method(method)
    try:
        spec = speculative_config(base, k or opts.get("k", 7), drafter)
    except MethodUnavailable as exc:
        return {"status": "unavailable", "reason": str(exc)}
    opts = dict(opts, levels=[(label, b, list(idx)) for label, b, idx in levels], k=k or opts.get("k", 7),
                max_num_seqs=max(b for _, b, _ in levels))
    res = (replay_in_fresh_process if fresh else replay_once)(target, spec, prompts, opts)
    out = {}
    for label, r in res["levels"].items():
        steady = [1000 * d[1] for d in r["draft_rounds"] if d[4]]
        out[label] = {**{key: v for key, v in r["summary"].items() if key != "method"},
                      "draft_round_ms": statistics.median(steady) if steady and spec else None,
                      "draft_rounds": len(steady) if spec else 0, "outputs": r["outputs"]}
    return {"status": "ok", "runner": res["runner"], "levels": out}


REPEATED_KEYS = ("output_tokens_per_s", "mean_itl_ms", "wall_s")


def combine_repeats(runs: list[dict]) -> dict:
    """One method's record from its ``--repeats`` passes (``repeats.combine_passes``: medians of
    tok/s, ITL and wall per concurrency, every pass's values and outputs kept); the top-level
    figures are the lowest concurrency's, like a single pass's."""
    first = combine_passes(runs, REPEATED_KEYS)
    if first["status"] == "ok" and len(runs) > 1:
        lowest = first["by_concurrency"][str(min(map(int, first["by_concurrency"])))]
        first.update({key: lowest[key] for key in REPEATED_KEYS})
    return first

SAME_RUN_KEYS = ("workload", "target", "k", "temperature", "max_tokens", "dtype", "seed", "concurrency",
                 "tensor_parallel_size", "num_requests", "prompt_tokens_min", "prompt_tokens_max", "max_model_len",
                 "device", "runner")


def previous_results(out: Path, settings: dict, methods: list[str]) -> tuple[dict, dict, dict]:
    """``--merge``: the results and greedy outputs of OUT's earlier run for the methods not run now,
    and that run's settings; refuses (exits) when they differ, since its figures would not compare."""
    res_path, out_path = out / "results.json", out / "outputs.json"
    if not res_path.is_file():
        return {}, {}, {}
    old = json.loads(res_path.read_text())
    earlier = {"runner": "v1", **old["settings"]}  # runs before --runner existed used V1
    diff = {k: (earlier.get(k), settings.get(k)) for k in SAME_RUN_KEYS if earlier.get(k) != settings.get(k)}
    if diff:
        raise SystemExit(f"--merge: {res_path} was measured with other settings {diff}; "
                         "rerun every method, or write to another --out")
    outputs = json.loads(out_path.read_text()) if out_path.is_file() else {}
    keep = [m for m in old["methods"] if m not in methods]
    return ({m: old["methods"][m] for m in keep},
            {m: {int(c): o for c, o in outputs[m].items()} for m in keep if m in outputs},
            old["settings"])


def write_markdown(path: Path, settings: dict, results: dict, concurrency: list[int]) -> None:
    lines = [f"# A/B: {Path(settings['workload']).name}", "",
             f"target `{settings['target']}`, K={settings['k']}, temperature {settings['temperature']}, "
             f"max {settings['max_tokens']} new tokens, dtype {settings['dtype']}, "
             f"{settings['num_requests']} requests ({settings['prompt_tokens_min']}-"
             f"{settings['prompt_tokens_max']} prompt tokens), device {settings['device']}, "
             f"tensor parallel {settings.get('tensor_parallel_size', 1)}, "
             f"vLLM Model Runner {settings.get('runner', 'v1').upper()}"
             + (f", {settings['repeats']} passes (tok/s: median (min-max), methods interleaved)"
                if settings.get("repeats", 1) > 1 else "") + ".", "",
             "| method | tau | per-position acceptance | "
             + " | ".join(f"tok/s @{c}" for c in concurrency)
             + " | ITL ms @1 | KV pool tokens | draft round ms @1k / 4k / 16k | drafter alone ms | "
            "identical to none |",
             "|" + " --- |" * (8 + len(concurrency))]
    for m, r in results.items():
        if r["status"] != "ok":
            lines.append(f"| {m} | {r['status']}: {r['reason']} |" + " |" * (7 + len(concurrency)))
            continue
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        pos = " ".join(f"{p:.2f}" for p in r["tau_per_position"]) or "-"
        tps = " | ".join(spread(r["by_concurrency"][str(c)], "output_tokens_per_s") for c in concurrency)
        by_ctx = r["draft_ms_by_context"]
        dm, alone = (" / ".join(f"{by_ctx[str(b)][key]:.2f}" if str(b) in by_ctx else "-" for b in CONTEXT_BUCKETS)
                     for key in ("median_ms", "drafter_median_ms"))
        lines.append(f"| {m} | {tau} | {pos} | {tps} | {r['mean_itl_ms']:.1f} | {r['kv_pool_tokens']:,} | "
                     f"{dm} | {alone} | {r.get('identical_to_none', '-')} |")
    lines += ["", "Tau by prompt length (lowest concurrency; vLLM's per-request acceptance histograms):", "",
              "| method | prompt tokens | requests | drafts | tau | per-position acceptance |",
              "| --- | --- | --- | --- | --- | --- |"]
    for m, r in results.items():
        buckets = r.get("tau_by_prompt_tokens") if r["status"] == "ok" else None
        if not buckets:  # failed, unavailable, or merged from a run made before this table existed
            lines.append(f"| {m} | - | - | - | - | {r['status'] if r['status'] != 'ok' else 'not recorded'} |")
            continue
        for name, _, _ in PROMPT_BUCKETS:
            b = buckets[name]
            tau = "-" if b["tau"] is None else f"{b['tau']:.2f}"
            pos = " ".join(f"{p:.2f}" for p in b["tau_per_position"]) or "-"
            lines.append(f"| {m} | {name} | {b['requests']} | {b['drafts']:,} | {tau} | {pos} |")
    lines += ["", f"Command: `{settings['command']}`", ""]
    for earlier in settings.get("earlier_commands", []):
        lines += [f"Merged from an earlier run with the same settings: `{earlier}`", ""]
    path.write_text("\n".join(lines))


def write_plots(out: Path, results: dict, concurrency: list[int]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install -e .[bench])"]
    ok = {m: r for m, r in results.items() if r["status"] == "ok"}
    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in ok.items():
        if r["tau_per_position"]:
            ax.plot(range(1, len(r["tau_per_position"]) + 1), r["tau_per_position"], marker="o", label=m)
    ax.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance per position", ylim=(0, 1))
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(out / "tau_per_position.png", dpi=120, bbox_inches="tight")
    made.append("tau_per_position.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in ok.items():
        ax.plot(concurrency, [r["by_concurrency"][str(c)]["output_tokens_per_s"] for c in concurrency],
                marker="o", label=m)
    ax.set(xlabel="concurrency (max_num_seqs)", ylabel="output tokens/s", title="Throughput", xscale="log")
    ax.legend()
    fig.savefig(out / "tokens_per_s_vs_concurrency.png", dpi=120, bbox_inches="tight")
    made.append("tokens_per_s_vs_concurrency.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in ok.items():
        pts = [(int(b), v["median_ms"]) for b, v in r["draft_ms_by_context"].items()]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=m)
    ax.set(xlabel="context length (tokens)", ylabel="draft round (ms, median)", xscale="log",
           title="Draft cost against context length")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(out / "draft_ms_vs_context.png", dpi=120, bbox_inches="tight")
    made.append("draft_ms_vs_context.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (m, r) in enumerate(ok.items()):
        buckets = r.get("tau_by_prompt_tokens") or {}
        color = f"C{i}"
        pts = [(p, 1 + a / d) for p, d, a in r.get("per_request_tau", []) if d]
        if pts:
            ax.scatter(*zip(*pts), s=8, alpha=0.25, color=color)
        centers = [(b["prompt_tokens_mean"], b["tau"]) for b in buckets.values() if b["tau"] is not None]
        if centers:
            ax.plot(*zip(*centers), marker="o", markersize=7, color=color, label=m)
    for _, lo, _ in PROMPT_BUCKETS[1:]:
        ax.axvline(lo, color="grey", lw=0.5, ls="--")
    ax.set(xlabel="prompt tokens", ylabel="tau (tokens per verification)", xscale="log",
           title="Tau against prompt length (large points: bucket 0-2k / 2k-8k / 8k-32k; dots: requests)")
    ax.title.set_fontsize(9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(out / "tau_by_prompt_tokens.png", dpi=120, bbox_inches="tight")
    made.append("tau_by_prompt_tokens.png")
    plt.close("all")
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, help="sessions JSONL (docs/design.md §6)")
    ap.add_argument("--methods", default="none,ngram,suffix,eagle3,dflash,dlite")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    for m in ("dlite", "eagle3", "dflash"):
        ap.add_argument(f"--{m}", default=str(default_drafter(m)), help=f"{m} drafter checkpoint")
    ap.add_argument("-k", "--k", type=int, default=None,
                    help="speculative tokens per round (default: the --dlite checkpoint's K)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runner", choices=("v1", "v2"), default=default_runner(),
                    help="vLLM model runner; v2 on CPU runs through Triton's interpreter (lab.harness.runners): "
                         "slow, and draft rounds are timed on v1 only")
    ap.add_argument("--compile", choices=sorted(COMPILE_MODES), default="vllm",
                    help="on a GPU: 'vllm' = vLLM's default torch.compile + CUDA graphs, 'none' = full CUDA graphs "
                         "of the decode/verify steps without torch.compile (ignored on CPU)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated max_num_seqs levels")
    ap.add_argument("--max-prompt-tokens", type=int, default=16384,
                    help="skip longer prompts; up to the target's context minus --max-tokens, K and 8 "
                         "(30000 on the tiny target, whose max_position_embeddings is 32768)")
    ap.add_argument("--max-requests", type=int, default=0, help="keep N requests spread evenly (0: all)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure every method and concurrency N times, methods interleaved, each in a fresh "
                         "engine; report medians and the spread")
    ap.add_argument("--merge", action="store_true",
                    help="keep the methods already in OUT/results.json that are not in --methods, when they "
                         "were measured with the same settings and requests (e.g. add a newly trained drafter)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="shard the target over N workers (on CPU each rank is pinned to its own cores; "
                         "draft times are not recorded then: the drafter runs in the workers)")
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, args.dlite)  # default: the drafter's own K
    from vllm_dlite.vllm.engine import METHODS

    try:  # bad options fail here, before any engine starts
        args.concurrency = sorted(int(c) for c in args.concurrency.split(","))
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers like 1,4,16, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: every level must be >= 1")
    args.max_model_len = args.max_prompt_tokens + args.max_tokens + args.k + MODEL_LEN_MARGIN
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        parsed = {m: parse_method(m) for m in methods}
    except ValueError:
        ap.error(f"--methods: {args.methods!r}: a method is NAME or NAME@k with an integer k (e.g. dlite@3)")
    unknown = [m for m, (base, _) in parsed.items() if base not in METHODS]
    if unknown or not methods:
        ap.error(f"--methods: unknown {unknown or 'empty list'}; choose from {','.join(METHODS)} "
                 "(NAME@k: that method with k tokens per round)")
    bad_k = [m for m, (base, k) in parsed.items() if k is not None and (base == "none" or not 1 <= k <= args.k)]
    if bad_k:
        ap.error(f"--methods: {bad_k}: NAME@k needs a speculative method and 1 <= k <= -k ({args.k}); "
                 "raise -k for a larger k")
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not Path(args.workload).is_file():
        ap.error(f"--workload: {args.workload} does not exist (a sessions JSONL, docs/design.md §6)")
    if args.max_prompt_tokens < 1:
        ap.error("--max-prompt-tokens must be >= 1")
    context = target_context(args.target)
    if context is not None and args.max_model_len > context:
        ap.error(f"--max-prompt-tokens {args.max_prompt_tokens}: the engine would need max model len "
                 f"{args.max_model_len} (prompt + --max-tokens {args.max_tokens} + K {args.k} + "
                 f"{MODEL_LEN_MARGIN}), more than the target's context (max_position_embeddings {context}); "
                 f"use --max-prompt-tokens {context - args.max_tokens - args.k - MODEL_LEN_MARGIN} or less")

    import torch
    from transformers import AutoTokenizer

    from vllm_dlite.train.workloads.replay import load_replay

    tok = AutoTokenizer.from_pretrained(args.target)
    requests = load_replay(args.workload, tok, max_prompt_tokens=args.max_prompt_tokens)
    if not requests:
        raise SystemExit(f"{args.workload}: no assistant turn with a prompt <= {args.max_prompt_tokens} tokens")
    if args.max_requests and len(requests) > args.max_requests:
        step = len(requests) / args.max_requests
        requests = [requests[int(i * step)] for i in range(args.max_requests)]
    prompts = [r.prompt_token_ids for r in requests]
    settings = dict(
        workload=args.workload, target=args.target, k=args.k, temperature=args.temperature,
        max_tokens=args.max_tokens, dtype=args.dtype, seed=args.seed, runner=args.runner, concurrency=args.concurrency,
        tensor_parallel_size=args.tensor_parallel_size, repeats=args.repeats, compile=args.compile,
        num_requests=len(prompts), prompt_tokens_min=min(map(len, prompts)),
        prompt_tokens_max=max(map(len, prompts)), max_model_len=args.max_model_len,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        drafters={m: getattr(args, m) for m in ("dlite", "eagle3", "dflash")
                  if any(drafter_family(x) == m for x in methods)},
        command="python benchmarks/ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    print(json.dumps(settings), flush=True)

    kept, kept_outputs, earlier = previous_results(args.out, settings, methods) if args.merge else ({}, {}, {})
    t0 = time.time()
    passes = [{m: run_method(args, m, prompts, getattr(args, drafter_family(m), None)) for m in methods}
              for _ in range(args.repeats)]  # methods interleaved: pass after pass
    results = {m: combine_repeats([p[m] for p in passes]) for m in methods}
    every_pass = {m: r.pop("_outputs") for m, r in results.items() if "_outputs" in r}
    outputs = {**kept_outputs, **{m: o[0] for m, o in every_pass.items()}}
    order = sorted({*results, *kept}, key=lambda m: (METHODS.index(parse_method(m)[0]), parse_method(m)[1] or args.k))
    results = {m: results.get(m) or kept[m] for m in order}
    base = outputs.get("none")
    for m, r in results.items():
        if base and m in outputs and m != "none" and args.temperature == 0:
            r["identical_to_none"] = all(o[c] == base[c] for o in every_pass.get(m, [outputs[m]])
                                         for c in o if c in base)
    settings["wall_s"] = round(time.time() - t0, 1)
    if kept:
        settings["merged_from_earlier_run"] = sorted(kept)
        settings["earlier_commands"] = [*earlier.get("earlier_commands", []), earlier["command"]]
        settings["drafters"] = {**earlier.get("drafters", {}), **settings["drafters"]}

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(dict(settings=settings, methods=results), indent=2) + "\n")
    (args.out / "outputs.json").write_text(json.dumps(outputs) + "\n")
    write_markdown(args.out / "results.md", settings, results, args.concurrency)
    notes = write_plots(args.out, results, args.concurrency)
    print((args.out / "results.md").read_text())
    print("\n".join(notes))
    if any(r.get("identical_to_none") is False for r in results.values()):
        print("error: some method changed the greedy output (speculative decoding must be lossless)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
