#!/usr/bin/env python3
"""Round by round inside the engine: what ``dlite-adaptive`` decided, and how well its cost model
predicted the steps that followed.

    OMP_NUM_THREADS=1 .venv/bin/python lab/experiments/adaptive_rounds.py \\
        --workload benchmarks/workloads/heldout_agentic.jsonl --max-requests 24 --max-prompt-tokens 8192 \\
        --concurrency 1 --out benchmarks/results/adaptive-rounds-agentic

``lab/experiments/draft_sources.py --costs`` replays the controller at fixed costs; this runs it in a
real engine (``ab.py``'s: one warm-up request, then the replay, in-process so the controller can be
watched) and logs every round of the proposer (:class:`~vllm_dlite.vllm.adaptive.AdaptiveController`):

* ``phase`` (explore / probe / decide), batch size, the rows' query lengths, the drafts the
  previous step verified and how many were accepted;
* before drafting: each row's expected accepted drafts from its running acceptance, the predicted
  rates with and without the drafter, and whether the drafter ran;
* after drafting: the draft lengths proposed and the draft round's seconds;
* the step that followed (end of one ``propose`` to the start of the next, decode-only steps):
  its measured seconds and the cost model's prediction of it, made when the round ended from the
  tokens proposed and (known afterwards) accepted.

Summary (``summary.json``, printed): rounds by phase; decide rounds and the share that drafted;
the cost model's one-step-ahead error (mean absolute and bias, ms) and the range of its per-token
slope over the run; tau and output tok/s of the replay. ``rounds.jsonl`` holds the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the controller lives in this process

from vllm_dlite.vllm.engine import use_cpu_env  # noqa: E402

use_cpu_env(4, threads=1)


def watch(controller_cls, rows: list[dict]) -> None:
    """Wrap the controller's four per-round calls to append one row per round to ``rows``."""
    from vllm_dlite.vllm.adaptive.cost import choose_lengths

    begin, plan, select, end = (controller_cls.begin_round, controller_cls.plan, controller_cls.select,
                                controller_cls.end_round)
    cur: dict = {}

    def begin_round(self, req_ids, scheduled, query_lens, rejected, live_req_ids=None, now=None):
        now = self.clock() if now is None else now
        decode = len(query_lens) > 0 and all(q == 1 + d for q, d in zip(query_lens, scheduled))
        if rows and decode and self._last_end is not None:
            rows[-1]["next_step_ms"] = 1e3 * (now - self._last_end)
            accepted = 0 if rejected is None else sum(max(0, d - r) for d, r in zip(scheduled, rejected) if d > 0)
            rows[-1]["next_step_predicted_ms"] = 1e3 * (rows[-1].pop("_predicted_s")
                                                        + self.cost.accepted_seconds() * accepted)
        cur.clear()
        cur.update(batch=len(req_ids), query_lens=list(query_lens), verified=list(map(int, scheduled)),
                   accepted=None if rejected is None else [max(0, int(d) - int(r)) for d, r in zip(scheduled, rejected)])
        return begin(self, req_ids, scheduled, query_lens, rejected, live_req_ids, now)

    def plan_(self, req_ids, k, suffix=None):
        p = [self.acceptance.cumulative(r, "dlite")[:k] for r in req_ids]
        choice = choose_lengths(p, [k] * len(req_ids), self.cost, len(req_ids), self.options.min_gain)
        out = plan(self, req_ids, k, suffix)
        cur.update(phase=out.phase, drafter_rows=len(out.dlite_rows),
                   expected_accepted=[round(float(np.sum(x)), 3) for x in p],
                   predicted_rate=choice.rate, predicted_base_rate=choice.base_rate,
                   token_ms=1e3 * self.cost.token_seconds(len(req_ids)))
        return out

    def select_(self, plan_, req_ids, k, confidence):
        lengths, sources = select(self, plan_, req_ids, k, confidence)
        cur["proposed"] = list(map(int, lengths))
        return lengths, sources

    def end_round(self, req_ids, sources, lengths, phase, draft_batch, draft_seconds, now=None):
        out = end(self, req_ids, sources, lengths, phase, draft_batch, draft_seconds, now)
        B = len(req_ids)
        cur.update(draft_ms=None if draft_seconds is None else 1e3 * draft_seconds,
                   _predicted_s=self.cost.step_seconds(B, B + int(sum(lengths))))
        rows.append(dict(cur))
        return out

    controller_cls.begin_round, controller_cls.plan = begin_round, plan_
    controller_cls.select, controller_cls.end_round = select_, end_round


def summarise(rows: list[dict], replay: dict) -> dict:
    phases: dict[str, int] = {}
    for r in rows:
        phases[r["phase"]] = phases.get(r["phase"], 0) + 1
    decide = [r for r in rows if r["phase"] == "decide"]
    err = np.array([r["next_step_predicted_ms"] - r["next_step_ms"] for r in rows if "next_step_ms" in r])
    token = np.array([r["token_ms"] for r in rows])
    steady = token[len(token) // 10:] if len(token) >= 10 else token  # past the first exploration
    return {
        "rounds": len(rows), "rounds_by_phase": phases,
        "decide_rounds": len(decide),
        "decide_rounds_drafting": sum(r["drafter_rows"] > 0 for r in decide),
        "mean_proposed_when_drafting": float(np.mean([np.mean(r["proposed"]) for r in decide if r["drafter_rows"]]))
        if any(r["drafter_rows"] for r in decide) else None,
        "step_prediction_mae_ms": float(np.abs(err).mean()) if len(err) else None,
        "step_prediction_bias_ms": float(err.mean()) if len(err) else None,
        "measured_step_median_ms": float(np.median([r["next_step_ms"] for r in rows if "next_step_ms" in r]))
        if len(err) else None,
        "token_ms_range_after_first_tenth": [float(steady.min()), float(steady.max())] if len(steady) else None,
        "draft_ms_median": float(np.median([r["draft_ms"] for r in rows if r["draft_ms"] is not None]))
        if any(r["draft_ms"] is not None for r in rows) else None,
        "tau": replay["tau"], "output_tokens_per_s": replay["output_tokens_per_s"], "wall_s": replay["wall_s"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--dlite", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--method", default="dlite-adaptive", choices=("dlite-adaptive", "dlite-hybrid"))
    ap.add_argument("-k", "--k", type=int, default=None, help="draft tokens per round (default: the --dlite checkpoint's K)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-requests", type=int, default=24)
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, args.dlite)  # default: the drafter's own K
    if not Path(args.workload).is_file():
        ap.error(f"--workload: {args.workload} does not exist")

    from transformers import AutoTokenizer

    from lab.harness.replay import replay_once
    from vllm_dlite.train.workloads.replay import load_replay
    from vllm_dlite.vllm.adaptive import AdaptiveController
    from vllm_dlite.vllm.engine import speculative_config

    tok = AutoTokenizer.from_pretrained(args.target)
    requests = load_replay(args.workload, tok, max_prompt_tokens=args.max_prompt_tokens)
    if args.max_requests and len(requests) > args.max_requests:  # ab.py's even spread
        step = len(requests) / args.max_requests
        requests = [requests[int(i * step)] for i in range(args.max_requests)]
    rows: list[dict] = []
    watch(AdaptiveController, rows)
    opts = dict(dtype="float32", max_model_len=args.max_prompt_tokens + args.max_tokens + args.k + 8, seed=0,
                max_num_seqs=args.concurrency, temperature=0.0, max_tokens=args.max_tokens)
    res = replay_once(args.target, speculative_config(args.method, args.k, args.dlite),
                      [r.prompt_token_ids for r in requests], opts)
    summary = summarise(rows, res["summary"]) | {"command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
                                                 "method": args.method, "concurrency": args.concurrency,
                                                 "num_requests": len(requests)}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "rounds.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
