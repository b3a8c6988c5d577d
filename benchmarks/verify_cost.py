#!/usr/bin/env python3
"""What a draft token costs: the target's verify step against the tokens it checks and the
context it attends to, and DLite's draft round, measured on the host this runs on.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verify_cost.py --out benchmarks/results/verify-cost

Speculation pays when a round yields more tokens than it costs in plain decode steps. On a GPU a
verify step of k+1 tokens costs about one decode step (both read the weights and the KV cache
once); where attention over the context is compute-bound (a CPU, a long context), each verified
token pays for that attention again, and the break-even rises with the context.

Terms (one request at a time, greedy, vLLM's in-process engine, prefix caching on):

* ``context`` L: tokens of the prompt found in the prefix cache (block-aligned; every measured
  request's ``num_cached_tokens`` is checked to be exactly L, else the run stops);
* ``decode_ms`` D(L): one plain decode step at context L, in an engine without speculation, in
  steady state: (a request ``prompt[:L+1]`` with ``max_tokens=1+M`` minus the same request with
  ``max_tokens=1``) / M, M = ``STEPS`` (a mean over steps, not the first one after the prefill);
* ``verify_ms[n-1]`` S(L, n), n = 1..K+1: a step that checks n tokens at context L (a decode step
  with n-1 drafts): D(L) plus what n new prompt tokens cost over 1 (requests ``prompt[:L+n]``
  against ``prompt[:L+1]``, ``max_tokens=1``: the same forward over n new positions on top of the
  cached L, without the rejection sampler);
* ``token_ms``: least-squares slope of S(L, n) over n, the marginal cost of one more draft token;
* ``draft_ms`` R(L): DLite's whole draft round (vLLM's runner call, ``lab.harness.replay.DraftTimer``),
  median of the rounds of requests at context L in an engine with the ``--dlite`` drafter, k = K;
* ``dlite_verify_ms``: the same engine's real verify step of K+1 tokens, in steady state: (a
  request ``prompt[:L+1]`` with ``max_tokens=1+M`` minus the same with ``max_tokens=1``, the draft
  rounds of both taken out) / its verify steps (its draft rounds minus one): a check of S(L, K+1);
* ``break_even_tau[k-1]`` = (S(L, k+1) + R(L)) / D(L): the tokens a round with k drafts must yield
  (tau, bonus token included) to be faster than no speculation; ``break_even_tau_free_draft`` the
  same with R = 0 (a drafter costing nothing). A measured tau above it means that k pays there.

Every figure is the median over ``--repeats`` sweeps (contexts and n interleaved within a sweep,
after one unrecorded warm-up sweep), with every sweep's value kept in ``repeats``. The prompt
tokens come from the workload's sessions rendered with the target's chat template (concatenated
until the longest context fits; their content does not change a step's cost).

Writes ``OUT/results.json`` and ``OUT/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # DraftTimer needs the in-process engine

from vllm_dlite.vllm.engine import use_cpu_env  # noqa: E402  (after the path)

use_cpu_env(4, threads=1)  # GiB: contexts to 30k tokens fit

STEPS = 16  # decode / verify steps timed per steady-state request
MODEL_LEN_MARGIN = STEPS  # max model len = longest context + k + this (>= its L + 1 + STEPS tokens: k >= 1)


# =========================================================================== analysis (no vLLM)
def summarise(sweeps: list[dict], k: int, steps: int) -> dict:
    """Per context, the medians over ``sweeps`` of what one sweep measured there.

    A sweep is ``{L: {"one": [s, ...] (max_tokens=1, n = 1..K+1 new tokens), "many": s (n = 1,
    max_tokens=1+steps), and with the drafter: "draft": [s, ...] (its steady-state rounds),
    "dlite_one": (s, s of its draft rounds), "dlite_many": (s, s of its draft rounds, rounds)}}``,
    seconds. Without the drafter's keys the draft and real-verify figures are None.
    """
    out = {}
    for L in sweeps[0]:
        cells = [s[L] for s in sweeps]
        decode = [(c["many"] - c["one"][0]) / steps for c in cells]
        verify = [[d + c["one"][n] - c["one"][0] for n in range(k + 1)] for c, d in zip(cells, decode)]
        row = {
            "decode_ms": 1e3 * statistics.median(decode),
            "verify_ms": [1e3 * statistics.median(v[n] for v in verify) for n in range(k + 1)],
            "repeats": {"decode_ms": [1e3 * d for d in decode],
                        "verify_ms": [[1e3 * x for x in v] for v in verify]},
        }
        row["token_ms"] = statistics.linear_regression(range(1, k + 2), row["verify_ms"]).slope
        drafts = [x for c in cells for x in (c.get("draft") or ())]
        row["draft_ms"] = 1e3 * statistics.median(drafts) if drafts else None
        real = [((c["dlite_many"][0] - c["dlite_many"][1]) - (c["dlite_one"][0] - c["dlite_one"][1]))
                / (c["dlite_many"][2] - 1) for c in cells if c.get("dlite_many") and c["dlite_many"][2] > 1]
        row["dlite_verify_ms"] = 1e3 * statistics.median(real) if real else None
        row["repeats"]["dlite_verify_ms"] = [1e3 * x for x in real]
        D, R = row["decode_ms"], row["draft_ms"] or 0.0
        row["break_even_tau"] = [(row["verify_ms"][j] + R) / D for j in range(1, k + 1)]
        row["break_even_tau_free_draft"] = [row["verify_ms"][j] / D for j in range(1, k + 1)]
        out[L] = row
    return out


# =========================================================================== measurement
def prompt_tokens(workload: str, target: str, length: int) -> list[int]:
    """At least ``length`` tokens: the workload's sessions, each rendered whole, one after another."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.workloads.schema import read_sessions
    from vllm_dlite.train.workloads.replay import chat_token_ids

    tok = AutoTokenizer.from_pretrained(target)
    ids: list[int] = []
    for s in sorted(read_sessions(workload), key=lambda s: -len(json.dumps(s["messages"]))):
        ids += chat_token_ids(tok, s["messages"], s.get("tools"), add_generation_prompt=False)
        if len(ids) >= length:
            return ids[:length]
    raise SystemExit(f"--workload {workload} renders to {len(ids)} tokens, but the longest of --contexts needs "
                     f"{length}: lower --contexts or pass a workload with longer sessions")


def measure(target: str, spec: dict | None, tokens: list[int], contexts: list[int], k: int,
            repeats: int, dtype: str) -> list[dict]:
    """Sweeps of one engine (run it ``lab.harness.processes.in_fresh_process``)."""
    from vllm import SamplingParams, TokensPrompt

    from lab.harness.replay import DraftTimer
    from vllm_dlite.vllm.engine import build_llm, shutdown
    from vllm_dlite.vllm.plugin import register

    register()
    llm = build_llm(target, spec, dtype=dtype, max_model_len=max(contexts) + k + MODEL_LEN_MARGIN,
                    max_num_seqs=1, enforce_eager=True, enable_prefix_caching=True)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    if any(L % block for L in contexts):
        raise SystemExit(f"--contexts {','.join(map(str, contexts))}: the prefix cache keeps whole blocks of {block} "
                         f"tokens here, so a context must be a multiple of {block}")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + STEPS, temperature=0.0, ignore_eos=True)

    def timed(L: int, n: int, params) -> tuple[float, list]:
        """Seconds of one request of L cached + n new prompt tokens, and its draft rounds (one per
        step with the drafter; ``DraftRound`` records)."""
        with DraftTimer() as timer:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens[:L + n])], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t
        if out.num_cached_tokens != L:
            raise RuntimeError(f"context {L}: the prefix cache held {out.num_cached_tokens} of the prompt's "
                               f"tokens, not {L}; the measurement would mix in prefill")
        return seconds, timer.records

    llm.generate([TokensPrompt(prompt_token_ids=tokens[:max(contexts)])], one, use_tqdm=False)  # fill the cache
    sweeps = []
    for sweep in range(repeats + 1):  # sweep 0: warm-up (kernel and allocator first calls)
        record = {}
        for L in contexts:
            if spec is None:
                ones = [timed(L, n, one)[0] for n in range(1, k + 2)]
                record[L] = {"one": ones, "many": timed(L, 1, many)[0]}
            else:
                (s1, rounds1), (sm, rounds) = timed(L, 1, one), timed(L, 1, many)
                record[L] = {"dlite_one": (s1, sum(r.seconds for r in rounds1)),
                             "dlite_many": (sm, sum(r.seconds for r in rounds), len(rounds)),
                             "draft": [r.seconds for r in rounds if r.verifying]}
        if sweep:
            sweeps.append(record)
    shutdown(llm)
    return sweeps


def markdown(settings: dict, rows: dict, k: int) -> str:
    show = sorted({j for j in (1, 2, 4, k) if j <= k})  # draft lengths in the break-even columns
    cols = [j + 1 for j in show]  # verify steps of those drafts
    lines = [
        "# What a draft token costs",
        "",
        f"target `{settings['target']}`, drafter `{settings['dlite']}` (k = {k}), one request at a time, greedy, "
        f"dtype {settings['dtype']}, prefix caching on, eager, device {settings['device']}; medians of "
        f"{settings['repeats']} sweeps (min-max). Terms: `benchmarks/verify_cost.py`.",
        "",
        "| context | decode step ms | verify step ms, n = " + " / ".join(map(str, cols)) + " tokens | ms per draft token "
        f"| DLite draft round ms | real verify of {k + 1} ms | break-even tau, k = "
        + " / ".join(map(str, show)) + " | same, drafting free |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for L, r in rows.items():
        dec = r["repeats"]["decode_ms"]
        real = "-" if r["dlite_verify_ms"] is None else f"{r['dlite_verify_ms']:.1f}"
        draft = "-" if r["draft_ms"] is None else f"{r['draft_ms']:.1f}"
        lines.append(
            f"| {L:,} | {r['decode_ms']:.1f} ({min(dec):.1f}-{max(dec):.1f}) | "
            + " / ".join(f"{r['verify_ms'][n - 1]:.1f}" for n in cols)
            + f" | {r['token_ms']:.2f} | {draft} | {real} | "
            + " / ".join(f"{r['break_even_tau'][j - 1]:.2f}" for j in show) + " | "
            + " / ".join(f"{r['break_even_tau_free_draft'][j - 1]:.2f}" for j in show) + " |")
    lines += ["", f"Command: `{settings['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--dlite", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"), help="drafter checkpoint")
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"),
                    help="sessions whose rendered tokens fill the context")
    ap.add_argument("--contexts", default="1024,4096,8192,16384,28672",
                    help="cached context lengths, comma-separated (multiples of the KV block size)")
    ap.add_argument("-k", "--k", type=int, default=None,
                    help="draft tokens per round (verify steps of 1..k+1 tokens; default: the --dlite checkpoint's K)")
    ap.add_argument("--repeats", type=int, default=9, help="recorded sweeps (after one warm-up sweep)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, args.dlite)  # default: the drafter's own K
    contexts = sorted({int(c) for c in args.contexts.split(",") if c.strip()})
    if not contexts or contexts[0] < 1 or args.k < 1 or args.repeats < 1:
        ap.error("--contexts needs positive lengths; -k and --repeats must be >= 1")
    from ab import target_context
    from lab.harness.processes import in_fresh_process
    from vllm_dlite.vllm.engine import speculative_config

    limit = target_context(args.target)
    if limit is not None and max(contexts) + args.k + MODEL_LEN_MARGIN > limit:
        ap.error(f"--contexts up to {max(contexts)} with -k {args.k} needs {max(contexts) + args.k + MODEL_LEN_MARGIN} "
                 f"positions, more than the target's {limit} (max_position_embeddings): lower --contexts")
    tokens = prompt_tokens(args.workload, args.target, max(contexts) + args.k + 1)
    target_sweeps = in_fresh_process(measure, args.target, None, tokens, contexts, args.k, args.repeats, args.dtype)
    dlite_sweeps = in_fresh_process(measure, args.target, speculative_config("dlite", args.k, args.dlite), tokens,
                                    contexts, args.k, args.repeats, args.dtype)
    sweeps = [{L: {**a[L], **b[L]} for L in contexts} for a, b in zip(target_sweeps, dlite_sweeps)]
    rows = summarise(sweeps, args.k, STEPS)
    import torch

    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else f"cpu ({len(os.sched_getaffinity(0))} cores)")
    settings = {"target": args.target, "dlite": args.dlite, "k": args.k, "dtype": args.dtype, "steps": STEPS,
                "repeats": args.repeats, "contexts": contexts, "device": device,
                "command": "python benchmarks/verify_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "by_context": rows}, indent=1))
    report = markdown(settings, rows, args.k)
    (args.out / "results.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
