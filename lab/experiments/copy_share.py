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
* ``reference match``: how close the target's reply is to what the session's author wrote
  (``difflib`` ratio of the reply's tokens against as many tokens of the reference turn, rendered
  with the chat template). It says whether the target still does the task at that prompt length.

Inputs: an ``ab.py`` result folder (``results.json``: settings and per-request tau per method;
``outputs.json``: each method's greedy outputs by concurrency, identical to no speculation's). The prompts are
rebuilt exactly as ``ab.py`` selected them (same workload, ``--max-prompt-tokens``,
``--max-requests``) and checked against the recorded prompt lengths.

* token-level acceptance (A/B runs at concurrency 1 on Model Runner V1, whose results hold
  ``per_request_rounds``: each verification's ``[drafted, accepted]`` in order): the reply grows by
  ``accepted + 1`` tokens per verification from the prefill's one token, so draft slot ``i`` of a
  verification that starts at reply position ``p`` proposed position ``p + i``. A slot is *reached*
  when every slot before it was accepted (slots ``0 .. min(accepted, drafted - 1)``); the
  acceptance of a class of positions (copied, not copied) = accepted reached slots / reached slots
  of that class: how often the drafter gets such a token right when it gets the chance.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.buckets import PROMPT_BUCKETS, prompt_bucket  # noqa: E402  (after the path)

N = 4  # match length that counts as a copy


def copied_positions(prompt: list[int], reply: list[int], n: int = N) -> list[bool]:
    """``[j]``: the ``n`` tokens ending at reply position ``j`` occur in ``prompt``."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    ctx = prompt[-(n - 1):] + reply
    return [tuple(ctx[j:j + n]) in grams for j in range(len(reply))]


def ab_requests(settings: dict) -> list[tuple[list[int], list[int]]]:
    """``(prompt, reference reply)`` token ids of the requests ``ab.py`` replayed with these
    settings (its selection, re-done)."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.workloads.replay import chat_token_ids, load_replay
    from vllm_dlite.train.workloads.schema import read_sessions

    command = settings["command"]
    limit = int(re.search(r"--max-prompt-tokens (\d+)", command).group(1))
    tok = AutoTokenizer.from_pretrained(REPO / "models" / Path(settings["target"]).name)
    requests = load_replay(str(REPO / settings["workload"]), tok, max_prompt_tokens=limit)
    n = settings["num_requests"]
    if len(requests) > n:
        step = len(requests) / n
        requests = [requests[int(i * step)] for i in range(n)]
    sessions = {s["id"]: s for s in read_sessions(str(REPO / settings["workload"]))}
    out = []
    for r in requests:
        s = sessions[r.session_id]
        full = chat_token_ids(tok, s["messages"][: r.turn + 1], s.get("tools"), add_generation_prompt=False)
        out.append((r.prompt_token_ids, full[len(r.prompt_token_ids):]))
    return out


def reference_match(reply: list[int], reference: list[int]) -> float:
    """``difflib`` ratio of the reply against as many tokens of the reference (1.0: the same)."""
    return difflib.SequenceMatcher(None, reply, reference[: len(reply)], autojunk=False).ratio()


def reached_slots(reply_len: int, rounds: list[list[int]]) -> tuple[list[tuple[int, bool]], int]:
    """``([(reply position, accepted)] of the reached draft slots inside the reply, tokens the
    verifications account for)`` for one request's ``[[drafted, accepted], ...]``."""
    p, out = 1, []
    for drafted, accepted in rounds:
        out += [(p + i, i < accepted) for i in range(min(accepted + 1, drafted)) if p + i < reply_len]
        p += accepted + 1
    return out, p


def tally_reached_slots(rounds: list, replies: list[list[int]], copied: list[list[bool]], names,
                        groups_of) -> dict:
    """``{group: {"copied": [accepted, reached], "not_copied": [...]}}`` over the reached draft slots
    of every request, a slot counted in each group ``groups_of(request, reply position)`` names
    (groups in the order of ``names``)."""
    cells = {g: {"copied": [0, 0], "not_copied": [0, 0]} for g in names}
    for i, reply in enumerate(replies):
        for pos, ok in reached_slots(len(reply), rounds[i])[0]:
            for g in groups_of(i, pos):
                c = cells[g]["copied" if copied[i][pos] else "not_copied"]
                c[0] += ok
                c[1] += 1
    return cells


def acceptance_cell(cell: dict) -> str:
    """``copied / not copied`` as ``accepted / reached`` in % with the reached slots in brackets."""
    return " / ".join(f"{a / r:.0%} ({r})" if r else "-" for a, r in (cell["copied"], cell["not_copied"]))


def token_acceptance(methods: dict, replies: list[list[int]], copied: list[list[bool]],
                     groups: dict[str, list[int]]) -> dict:
    """Per method and group of requests: acceptance of reached slots on copied and on non-copied
    reply positions (``{"copied": [accepted, reached], "not_copied": [...]}``)."""
    out = {}
    in_groups = [[g for g, idx in groups.items() if i in idx] for i in range(len(replies))]
    for m, r in methods.items():
        rounds = r.get("per_request_rounds")
        if not rounds:
            continue
        for i, reply in enumerate(replies):  # the last verification ends the reply
            _, covered = reached_slots(len(reply), rounds[i])
            last = rounds[i][-1][1] + 1 if rounds[i] else 0
            if not covered - last < len(reply) <= covered:
                raise SystemExit(f"{m}: request {i}'s verifications cover {covered} tokens, its reply {len(reply)}")
        out[m] = tally_reached_slots(rounds, replies, copied, groups, lambda i, pos: in_groups[i])
    return out


def training_length(drafter: str | Path) -> int | None:
    """The longest sequence a drafter was trained on, in tokens: a DLite export's
    ``training_report.json`` (``config.data.max_len``, its last cycle), a baseline's ``--max-len``
    (the command in its README); None when the directory says neither."""
    d = Path(drafter)
    if (d / "training_report.json").is_file():
        return json.loads((d / "training_report.json").read_text())["config"]["data"]["max_len"]
    found = re.search(r"--max-len (\d+)", (d / "README.md").read_text()) if (d / "README.md").is_file() else None
    return int(found.group(1)) if found else None


def acceptance_past_training_length(methods: dict, prompt_tokens: list[int], replies: list[list[int]],
                                    copied: list[list[bool]], lengths: dict[str, int]) -> dict:
    """Per method with a training length ``L``: acceptance of the reached draft slots whose absolute
    position (prompt tokens + reply position) is ``<= L`` (``within``) and ``> L`` (``past``), on
    copied and non-copied reply positions (``[accepted, reached]`` each)."""
    out = {}
    for m, length in lengths.items():
        rounds = methods[m].get("per_request_rounds")
        if not rounds or not length:
            continue
        cells = tally_reached_slots(rounds, replies, copied, ("within", "past"), lambda i, pos, n=length:
                                    ("past" if prompt_tokens[i] + pos > n else "within",))
        out[m] = dict(training_length=length, **cells)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ab", type=Path, required=True, help="an ab.py result folder")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    results = json.loads((args.ab / "results.json").read_text())
    outputs = json.loads((args.ab / "outputs.json").read_text())
    requests = ab_requests(results["settings"])
    prompts = [p for p, _ in requests]
    methods = {m: r for m, r in results["methods"].items() if any(d for _, d, _ in r.get("per_request_tau") or ())}
    for m, r in methods.items():
        lengths = [p for p, _, _ in r["per_request_tau"]]
        if lengths != [len(p) for p in prompts]:
            raise SystemExit(f"{m}: the rebuilt prompts do not match the A/B's prompt lengths")
    # the greedy outputs at concurrency 1 (every method's are no speculation's)
    replies = (outputs.get("none") or next(iter(outputs.values())))["1"]
    if any(o["1"] != replies for o in outputs.values()):
        raise SystemExit("the methods' outputs differ: a greedy A/B's must not")
    per_request, copied_by_request = [], []
    for i, ((prompt, reference), reply) in enumerate(zip(requests, replies)):
        copied = copied_positions(prompt, reply)
        copied_by_request.append(copied)
        row = dict(request=i, prompt_tokens=len(prompt), bucket=prompt_bucket(len(prompt)),
                   reply_tokens=len(reply), copied=sum(copied),
                   reference_match=reference_match(reply, reference))
        for m, r in methods.items():
            _, drafts, accepted = r["per_request_tau"][i]
            row[m] = 1 + accepted / drafts if drafts else None
        per_request.append(row)

    lines = [f"# Copy share of the replies, and acceptance ({args.ab.name})", "",
             f"Command: `.venv/bin/python lab/experiments/copy_share.py --ab {args.ab} --out {args.out}`", "",
             f"A reply position is *copied* when the {N} tokens ending there occur in the prompt. "
             "Replies: the target's greedy outputs (identical for every method). "
             "Tau: vLLM's per-request acceptance at concurrency 1.", "",
             "| prompt tokens | requests | reply tokens | copied | copy share | reference match | "
             + " | ".join(f"{m} tau, low / high copy half" for m in methods) + " |",
             "| --- " * (6 + len(methods)) + "|"]
    summary = {}
    for name, _, _ in PROMPT_BUCKETS:
        rows = [r for r in per_request if r["bucket"] == name]
        if not rows:
            continue
        reply, copied = sum(r["reply_tokens"] for r in rows), sum(r["copied"] for r in rows)
        rows_by_share = sorted(rows, key=lambda r: r["copied"] / max(r["reply_tokens"], 1))
        low, high = rows_by_share[: len(rows) // 2], rows_by_share[len(rows) // 2:]
        match = statistics.mean(r["reference_match"] for r in rows)
        cells, summary[name] = [], dict(requests=len(rows), reply_tokens=reply, copied=copied,
                                        copy_share=copied / reply if reply else None,
                                        reference_match=match)
        for m in methods:
            def mean_tau(group, m=m):
                taus = [r[m] for r in group if r[m] is not None]
                return statistics.mean(taus) if taus else None
            lo, hi = mean_tau(low), mean_tau(high)
            summary[name][m] = dict(low_copy_tau=lo, high_copy_tau=hi)
            cells.append(f"{lo:.2f} / {hi:.2f}" if lo is not None and hi is not None else "-")
        lines.append(f"| {name} | {len(rows)} | {reply} | {copied} | {copied / reply:.0%} | {match:.2f} | "
                     + " | ".join(cells) + " |")

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
    groups = {name: [i for i, r in enumerate(per_request) if r["bucket"] == name] for name, _, _ in PROMPT_BUCKETS}
    groups.update({f"{lo}-{hi}": [i for i, r in enumerate(per_request) if lo < r["prompt_tokens"] <= hi]
                   for lo, hi in ranges})
    groups["all"] = list(range(len(per_request)))
    tokens = token_acceptance(methods, replies, copied_by_request, {g: i for g, i in groups.items() if i})
    if tokens:
        lines += ["", "Token level: acceptance of the reached draft slots on copied / non-copied reply positions "
                  "(accepted / reached, in %; reached slots in brackets):", "",
                  "| prompt tokens | " + " | ".join(f"{m}: copied / not copied" for m in tokens) + " |",
                  "| --- " * (1 + len(tokens)) + "|"]
        for g in next(iter(tokens.values())):
            cells = []
            for m in tokens:
                cells.append(acceptance_cell(tokens[m][g]))
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lengths = {m: training_length(d) for m, d in results["settings"].get("drafters", {}).items() if m in methods}
    past = acceptance_past_training_length(methods, [len(p) for p in prompts], replies, copied_by_request,
                                           {m: n for m, n in lengths.items() if n})
    if past:
        lines += ["", "Absolute position (prompt tokens + reply position) against each drafter's training length "
                  "(the longest sequence it trained on): acceptance of the reached draft slots, copied / not copied "
                  "(accepted / reached, in %; reached slots in brackets):", "",
                  "| method | training length | within: copied / not copied | past: copied / not copied |",
                  "| --- | --- | --- | --- |"]
        for m, cell in past.items():
            lines.append(f"| {m} | {cell['training_length']:,} | {acceptance_cell(cell['within'])} | "
                         f"{acceptance_cell(cell['past'])} |")
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
                                                          token_acceptance=tokens,
                                                          past_training_length=past,
                                                          per_request=per_request), indent=2))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
