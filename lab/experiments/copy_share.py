#!/usr/bin/env python3
"""How much of the target's replies is copied from the prompt, and does acceptance follow it?

    .venv/bin/python lab/experiments/copy_share.py --ab benchmarks/results/ab-agentic-paper-protocol \\
        --out benchmarks/results/copy-share-agentic

Question (issue 38, item 3): on our target EAGLE-3's acceptance rises with the prompt length,
where the paper and speculators#684 see history-keeping drafters fall. If long-prompt replies are
mostly copies of the context, every drafter gets easy tokens there and the workload does not test
the paper's premise.

Terms:

* ``copied`` reply position ``j``: the 4 tokens ending at ``j`` (the prompt's tail fills in for
  ``j < 3``) occur somewhere in the prompt: a suffix match of >= 4 tokens into the prompt.
* ``copy share``: copied positions / reply tokens, over a prompt bucket's requests.
* per-request tau (from the A/B's ``per_request_tau``: vLLM's per-request acceptance histograms,
  concurrency 1): ``1 + accepted / drafts`` of that request.

Inputs: an ``ab.py`` result folder (``results.json``: settings and per-request tau per method;
``outputs.json``: each method's greedy outputs by concurrency, identical to no speculation's). The prompts are
rebuilt exactly as ``ab.py`` selected them (same workload, ``--max-prompt-tokens``,
``--max-requests``) and checked against the recorded prompt lengths.

What it cannot say: vLLM records acceptance per request, not per position, so acceptance on copied
against non-copied positions is read from requests with high against low copy share, not token by
token.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

BUCKETS = (("0-2k", 0, 2048), ("2k-8k", 2048, 8192), ("8k-32k", 8192, 1 << 30))
N = 4  # match length that counts as a copy


def copied_positions(prompt: list[int], reply: list[int], n: int = N) -> list[bool]:
    """``[j]``: the ``n`` tokens ending at reply position ``j`` occur in ``prompt``."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    ctx = prompt[-(n - 1):] + reply
    return [tuple(ctx[j:j + n]) in grams for j in range(len(reply))]


def bucket_of(tokens: int) -> str:
    return next(name for name, lo, hi in BUCKETS if lo <= tokens < hi)


def ab_prompts(settings: dict) -> list[list[int]]:
    """The prompts ``ab.py`` replayed with these settings (its selection, re-done)."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.workloads.replay import load_replay

    command = settings["command"]
    limit = int(re.search(r"--max-prompt-tokens (\d+)", command).group(1))
    tok = AutoTokenizer.from_pretrained(REPO / "models" / Path(settings["target"]).name)
    requests = load_replay(str(REPO / settings["workload"]), tok, max_prompt_tokens=limit)
    n = settings["num_requests"]
    if len(requests) > n:
        step = len(requests) / n
        requests = [requests[int(i * step)] for i in range(n)]
    return [r.prompt_token_ids for r in requests]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ab", type=Path, required=True, help="an ab.py result folder")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    results = json.loads((args.ab / "results.json").read_text())
    outputs = json.loads((args.ab / "outputs.json").read_text())
    prompts = ab_prompts(results["settings"])
    methods = {m: r for m, r in results["methods"].items() if any(d for _, d, _ in r.get("per_request_tau") or ())}
    for m, r in methods.items():
        lengths = [p for p, _, _ in r["per_request_tau"]]
        if lengths != [len(p) for p in prompts]:
            raise SystemExit(f"{m}: the rebuilt prompts do not match the A/B's prompt lengths")
    replies = outputs["none"]["1"]  # by concurrency: the greedy outputs at concurrency 1
    per_request = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        copied = copied_positions(prompt, reply)
        row = dict(request=i, prompt_tokens=len(prompt), bucket=bucket_of(len(prompt)),
                   reply_tokens=len(reply), copied=sum(copied))
        for m, r in methods.items():
            _, drafts, accepted = r["per_request_tau"][i]
            row[m] = 1 + accepted / drafts if drafts else None
        per_request.append(row)

    lines = [f"# Copy share of the replies, and acceptance ({args.ab.name})", "",
             f"Command: `.venv/bin/python lab/experiments/copy_share.py --ab {args.ab} --out {args.out}`", "",
             f"A reply position is *copied* when the {N} tokens ending there occur in the prompt. "
             "Replies: the target's greedy outputs (identical for every method). "
             "Tau: vLLM's per-request acceptance at concurrency 1.", "",
             "| prompt tokens | requests | reply tokens | copied | copy share | "
             + " | ".join(f"{m} tau, low / high copy half" for m in methods) + " |",
             "| --- " * (5 + len(methods)) + "|"]
    summary = {}
    for name, _, _ in BUCKETS:
        rows = [r for r in per_request if r["bucket"] == name]
        if not rows:
            continue
        reply, copied = sum(r["reply_tokens"] for r in rows), sum(r["copied"] for r in rows)
        rows_by_share = sorted(rows, key=lambda r: r["copied"] / max(r["reply_tokens"], 1))
        low, high = rows_by_share[: len(rows) // 2], rows_by_share[len(rows) // 2:]
        cells, summary[name] = [], dict(requests=len(rows), reply_tokens=reply, copied=copied,
                                        copy_share=copied / reply if reply else None)
        for m in methods:
            def mean_tau(group, m=m):
                taus = [r[m] for r in group if r[m] is not None]
                return statistics.mean(taus) if taus else None
            lo, hi = mean_tau(low), mean_tau(high)
            summary[name][m] = dict(low_copy_tau=lo, high_copy_tau=hi)
            cells.append(f"{lo:.2f} / {hi:.2f}" if lo is not None and hi is not None else "-")
        lines.append(f"| {name} | {len(rows)} | {reply} | {copied} | {copied / reply:.0%} | " + " | ".join(cells) + " |")

    lines += ["", "Per request, by prompt length (tau per method):", "",
              "| prompt tokens | copy share | " + " | ".join(methods) + " |", "| --- " * (2 + len(methods)) + "|"]
    for r in sorted(per_request, key=lambda r: r["prompt_tokens"]):
        share = r["copied"] / max(r["reply_tokens"], 1)
        lines.append(f"| {r['prompt_tokens']:,} | {share:.0%} | "
                     + " | ".join(f"{r[m]:.2f}" if r[m] is not None else "-" for m in methods) + " |")
    ranges = ((0, 4096), (4096, 8192), (8192, 16384), (16384, 32768))
    lines += ["", "Tau by prompt length around EAGLE-3's 4,096-token training length (accepted / drafts pooled):",
              "", "| prompt tokens | requests | copy share | " + " | ".join(methods) + " |",
              "| --- " * (3 + len(methods)) + "|"]
    by_length = {}
    for lo, hi in ranges:
        idx = [i for i, r in enumerate(per_request) if lo < r["prompt_tokens"] <= hi]
        if not idx:
            continue
        reply = sum(per_request[i]["reply_tokens"] for i in idx)
        share = sum(per_request[i]["copied"] for i in idx) / reply
        taus = {}
        for m, r in methods.items():
            drafts = sum(r["per_request_tau"][i][1] for i in idx)
            taus[m] = 1 + sum(r["per_request_tau"][i][2] for i in idx) / drafts if drafts else None
        by_length[f"{lo}-{hi}"] = dict(requests=len(idx), copy_share=share, tau=taus)
        lines.append(f"| {lo:,}-{hi:,} | {len(idx)} | {share:.0%} | "
                     + " | ".join(f"{t:.2f}" if t else "-" for t in taus.values()) + " |")
    corr = {}
    shares = [r["copied"] / max(r["reply_tokens"], 1) for r in per_request]
    for m in methods:
        pairs = [(s, r[m]) for s, r in zip(shares, per_request) if r[m] is not None]
        if len(pairs) > 2:
            corr[m] = statistics.correlation(*zip(*pairs))
    lines += ["", "Pearson correlation of per-request copy share and tau: "
              + ", ".join(f"{m} {c:.2f}" for m, c in corr.items()) + "."]

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(dict(ab=str(args.ab), n=N, buckets=summary,
                                                          correlation=corr, by_length=by_length,
                                                          per_request=per_request), indent=2))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
