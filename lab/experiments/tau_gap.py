#!/usr/bin/env python3
"""Is a tau gap between two drafters larger than the turns' own spread? A paired bootstrap.

    .venv/bin/python lab/experiments/tau_gap.py --pair dlite:eagle3 \\
        benchmarks/results/ab-agentic-paper-protocol benchmarks/results/ab-code-paper-protocol ...

Issue 38's targets compare tau on 48 / 24 / 24 held-out turns; a difference of 0.06 on 24 chat
turns may be the turns, not the drafters. Every method in one ``ab.py`` run drafted for the same
requests, so the comparison is paired:

* per-request record (``results.json``, ``methods[m].per_request_tau``, concurrency 1):
  ``[prompt_tokens, drafts, accepted]``; ``drafts`` = verification rounds with a draft.
* ``tau`` of a set of requests = ``1 + sum(accepted) / sum(drafts)`` (the A/B's pooled tau).
* ``ratio`` = tau(A) / tau(B) on the same requests.
* bootstrap: draw the bucket's requests with replacement ``--samples`` times (seed 0), the same
  draw for A and B; report the 2.5 / 97.5 percentiles of ``ratio`` and ``P(ratio >= 1)``, the
  share of draws where A is at least as good as B.

Prompt buckets are the A/B's (0-2k / 2k-8k / 8k-32k) plus ``all``. Requests are matched by index
and their prompt lengths checked equal. Output: a markdown table on stdout (``--out`` also writes
it to a file, with the command).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.buckets import PROMPT_BUCKETS  # noqa: E402  (the A/B's prompt buckets)


def load(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def per_request(result: dict, method: str) -> np.ndarray:
    """``[n, 3]`` int array: prompt tokens, drafts, accepted (concurrency 1)."""
    try:
        rows = result["methods"][method]["per_request_tau"]
    except KeyError:
        sys.exit(f"{result['settings']['workload']}: no per-request records for {method!r} "
                 f"(methods: {sorted(result['methods'])}); re-run ab.py with it")
    return np.asarray(rows, dtype=np.int64)


def tau(rows: np.ndarray) -> np.ndarray:
    """Pooled tau of ``rows [..., n, 3]`` over its requests axis: a scalar for ``[n, 3]``,
    one per draw for ``[draws, n, 3]``."""
    return 1.0 + rows[..., 2].sum(-1) / np.maximum(rows[..., 1].sum(-1), 1)


def compare(a: np.ndarray, b: np.ndarray, samples: int, rng: np.random.Generator) -> dict:
    """Paired bootstrap of tau(a) / tau(b) over the rows (same requests in the same order)."""
    n = len(a)
    idx = rng.integers(0, n, size=(samples, n))  # the same draws for a and b
    ratio = tau(a[idx]) / tau(b[idx])
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return dict(n=n, tau_a=float(tau(a)), tau_b=float(tau(b)), ratio=float(tau(a) / tau(b)), lo=float(lo), hi=float(hi),
                p_a_ge_b=float((ratio >= 1.0).mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="ab.py result folders (results.json)")
    ap.add_argument("--pair", action="append", required=True, metavar="A:B",
                    help="methods to compare, A against B (repeatable), e.g. dlite:eagle3")
    ap.add_argument("--samples", type=int, default=10000)
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args()

    lines = ["| workload | A vs B | prompts | turns | tau A | tau B | A / B | 95% interval | P(A >= B) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for folder in args.folders:
        result = load(folder)
        for pair in args.pair:
            a_name, _, b_name = pair.partition(":")
            a, b = per_request(result, a_name), per_request(result, b_name)
            if len(a) != len(b) or not np.array_equal(a[:, 0], b[:, 0]):
                sys.exit(f"{folder}: {a_name} and {b_name} did not draft for the same requests")
            for bucket, lo, hi in (("all", 0, 1 << 30),) + PROMPT_BUCKETS:
                keep = (a[:, 0] >= lo) & (a[:, 0] < hi)
                if not keep.any() or (bucket != "all" and keep.all()):
                    continue  # empty, or the same as "all"
                c = compare(a[keep], b[keep], args.samples, np.random.default_rng(0))
                lines.append(f"| {folder.name} | {a_name} vs {b_name} | {bucket} | {c['n']} | "
                             f"{c['tau_a']:.2f} | {c['tau_b']:.2f} | {c['ratio']:.3f} | "
                             f"{c['lo']:.3f}-{c['hi']:.3f} | {c['p_a_ge_b']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        cmd = " ".join(["python lab/experiments/tau_gap.py"] + [shlex.quote(a) for a in sys.argv[1:]])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Paired bootstrap of tau ratios\n\n{table}\n\nCommand: `{cmd}`\n")


if __name__ == "__main__":
    main()
