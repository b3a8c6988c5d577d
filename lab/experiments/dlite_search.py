#!/usr/bin/env python3
"""Search for the best DLite drafter of the tiny target within a fixed training budget.

    .venv/bin/python lab/experiments/dlite_search.py run --jobs 2 \\
        r128="model.sequential_rank=128" r256="model.sequential_rank=256"
    .venv/bin/python lab/experiments/dlite_search.py eval shipped=models/dlite-qwen3-tiny-stdlib
    .venv/bin/python lab/experiments/dlite_search.py report --out benchmarks/results/dlite-search
    # the finalists on long agentic turns (the validation split's prompts stop at 8k):
    .venv/bin/python lab/experiments/dlite_search.py eval --kinds '{"agentic": 12}' \\
        --max-prompt-tokens 30000 --results runs/search/results-long.jsonl A=runs/search/A/model ...
    .venv/bin/python lab/experiments/dlite_search.py report --results runs/search/results-long.jsonl \\
        --out benchmarks/results/dlite-search --name long-agentic
    # which training replies change when the target reads the whole prompt (data.max_len 32768):
    .venv/bin/python lab/experiments/dlite_search.py compare-data base long

Every candidate is ``python -m vllm_dlite.train --config configs/dlite-tiny.yaml`` plus its
``--set`` overrides (space-separated ``key=value``), one thread each, on ONE regenerated data set
and ONE set of feature files under ``runs/search/`` (so candidates differ only in what they set;
``run --data NAME`` trains on another regeneration, see ``data_paths``).
The first candidate runs alone until it has written the feature files; the rest then share them.

Selection never reads the held-out files. Each trained candidate is scored by the trainer's
offline greedy estimate (``vllm_dlite.train.offline_eval``, K = the drafter's, HF target, fp32) on a
**validation split**: the config's ``eval`` section, sessions of the *training* split generated
with a seed (2) that the drafter's data (seed 1) and the target's (seed 0) did not use. ``report`` prints, per
candidate: its settings, training seconds per stage (the budget is the sum over candidates),
optimizer steps, the validation tau overall and per kind, and per-position acceptance.

Results accumulate in ``runs/search/results.jsonl``; ``report --out`` writes ``search.json`` and
``table.md`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "runs" / "search"
SEQUENCES = ROOT / "base" / "data" / "sequences.jsonl"  # `--only-data --work-dir runs/search/base`
FEATURES = ROOT / "features"


def data_paths(data: str) -> tuple[Path, Path]:
    """A regenerated data set's sequences and feature files: ``base`` (data.max_len 4096, the
    config's), or another ``--only-data --work-dir runs/search/NAME`` regeneration (e.g. ``long``:
    ``--set data.max_len=32768``, so long agentic turns keep their whole prompt)."""
    if data == "base":
        return SEQUENCES, FEATURES
    return ROOT / data / "data" / "sequences.jsonl", ROOT / f"features-{data}"
RESULTS = ROOT / "results.jsonl"
CONFIG = "configs/dlite-tiny.yaml"


def validation() -> dict:
    """The validation split, from the config's ``eval`` section (train-split sessions of a seed the
    data did not use; ``TrainConfig.validate`` refuses the training seed)."""
    from vllm_dlite.train.cli import load_config_file
    from vllm_dlite.train.config import TrainConfig

    e = TrainConfig.from_dict(load_config_file(str(REPO / CONFIG))).validate().eval
    assert e.kinds and e.split == "train" and not e.workloads, f"{CONFIG}: eval is not a validation split"
    return dict(kinds=e.kinds, split=e.split, seed=e.seed, max_requests_per_kind=e.max_requests_per_kind,
                max_new_tokens=e.max_new_tokens, max_prompt_tokens=e.max_prompt_tokens)


def train_command(name: str, sets: list[str], data: str = "base") -> list[str]:
    sequences, features = data_paths(data)
    cmd = [sys.executable, "-m", "vllm_dlite.train", "--config", CONFIG,
           "--sequences", str(sequences), "--set", f"data.features_dir={features}",
           "--out", str(ROOT / name / "model"), "--work-dir", str(ROOT / name)]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def row_of(name: str, sets: list[str], drafter: str, rep: dict, ev: dict) -> dict:
    """One results.jsonl row: a drafter's training report and its validation estimate."""
    return dict(
        name=name, sets=sets, drafter=drafter,
        train_s={s: v["wall_s"] for s, v in rep.get("stages", {}).items()},
        steps={s: v["steps"] for s, v in rep.get("stages", {}).items()},
        epochs=rep["config"]["epochs"], parameters=rep["model"]["drafter_parameters"],
        val_tau=ev["overall"]["tau"], val_tau_by_kind={k: v["tau"] for k, v in ev["per_kind"].items()},
        val_acceptance=ev["overall"]["acceptance_rate_per_position"],
        val_requests=ev["overall"]["requests"], final_train_metrics=rep.get("final_metrics"),
    )


def record(row: dict, path: Path = RESULTS) -> dict:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def cmd_run(args: argparse.Namespace) -> None:
    sequences, _ = data_paths(args.data)
    if not Path(str(sequences) + ".meta.json").exists():  # written when the regeneration completes
        sys.exit(f"{sequences} missing: run `python -m vllm_dlite.train --config {CONFIG} "
                 f"--work-dir runs/search/{args.data} --only-data` first")
    todo = [(c.split("=", 1)[0], c.split("=", 1)[1].split()) for c in args.candidates]
    if args.data != "base":  # the data set is part of what a candidate sets
        todo = [(name, [f"data={args.data}"] + sets) for name, sets in todo]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    running: list[tuple[str, list[str], subprocess.Popen]] = []
    while todo or running:
        # the first candidate writes the shared feature files; the others start once it trains
        features_ready = not running or any((ROOT / n / "metrics.jsonl").exists() for n, _, _ in running)
        while todo and len(running) < args.jobs and (features_ready or not running):
            name, sets = todo.pop(0)
            (ROOT / name).mkdir(parents=True, exist_ok=True)
            log = open(ROOT / name / "train.log", "a")
            print(f"[search] start {name}: {' '.join(sets)}", flush=True)
            running.append((name, sets, subprocess.Popen(
                train_command(name, [s for s in sets if not s.startswith("data=")], args.data), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)))
            features_ready = False  # wait for this one to reach training before the next
        time.sleep(10)
        for item in list(running):
            name, sets, proc = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode:
                print(f"[search] {name} FAILED (exit {proc.returncode}): {ROOT / name / 'train.log'}")
                continue
            rep = json.loads((ROOT / name / "model" / "training_report.json").read_text())
            row = record(row_of(name, sets, str((ROOT / name / "model").relative_to(REPO)), rep,
                                rep["offline_eval"]))
            print(f"[search] done {name}: val tau {row['val_tau']} {row['val_tau_by_kind']} "
                  f"train {sum(row['train_s'].values()):.0f} s", flush=True)


def cmd_eval(args: argparse.Namespace) -> None:
    """Score existing drafters on the validation split (no training; e.g. the shipped one).
    ``--kinds`` / ``--max-prompt-tokens`` change the split's kinds and prompt cap (e.g. long agentic
    turns only); such rows go to ``--results``, apart from the search's."""
    from vllm_dlite.train.offline_eval import evaluate

    split = validation()
    if args.kinds:
        split["kinds"] = json.loads(args.kinds)
    if args.max_prompt_tokens:
        split["max_prompt_tokens"] = args.max_prompt_tokens
    for item in args.drafters:
        name, path = item.split("=", 1)
        ev = evaluate(target=str(REPO / "models" / "qwen3-tiny-stdlib"), drafter=path,
                      check_lossless=False, dtype="float32", progress=False, **split)
        rep = json.loads((Path(path) / "training_report.json").read_text())
        row = record(dict(row_of(name, [args.note], path, rep, ev), validation=split), Path(args.results))
        print(f"[search] {name}: val tau {row['val_tau']} {row['val_tau_by_kind']}")


def cmd_overlap(args: argparse.Namespace) -> None:
    """How far the validation split is from the training data: validation prompts that are also a
    training prompt, and session ids the two share."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.offline_eval import load_requests

    tok = AutoTokenizer.from_pretrained(str(REPO / "models" / "qwen3-tiny-stdlib"))
    train = [json.loads(line) for line in SEQUENCES.read_text().splitlines() if line.strip()]
    prompts = {tuple(t["token_ids"][:t["prompt_len"]]) for t in train}
    sessions = {t["session_id"] for t in train}
    v = validation()
    val = load_requests(tok, (), v["kinds"], v["split"], v["seed"], v["max_prompt_tokens"],
                        v["max_requests_per_kind"])
    same = sum(tuple(r.prompt_token_ids) in prompts for r in val)
    shared_ids = sum(r.session_id in sessions for r in val)
    print(f"validation requests {len(val)} (split train, seed {v['seed']}); training sequences "
          f"{len(train)}: identical prompts {same}, shared session ids {shared_ids}")


def cmd_compare_data(args: argparse.Namespace) -> None:
    """Two regenerations of the same sessions (e.g. ``base`` at data.max_len 4096 and ``long`` at
    32768): which training replies change when the target reads the whole prompt."""
    def load(data: str) -> dict:
        path = data_paths(data)[0]
        return {r["id"]: r for r in map(json.loads, path.read_text().splitlines()) if r}

    def reply(r: dict) -> list:
        return r["token_ids"][r["prompt_len"]:]

    a, b = load(args.a), load(args.b)
    tokens = sum(len(reply(r)) for r in a.values())
    longer = [k for k in a if k in b and len(b[k]["token_ids"]) > len(a[k]["token_ids"])]
    changed = [k for k in longer if reply(a[k]) != reply(b[k])]
    changed_tokens = sum(len(reply(a[k])) for k in changed)
    kinds = {kind: sum(a[k]["kind"] == kind for k in changed) for kind in sorted({r["kind"] for r in a.values()})}
    print(f"{args.a}: {len(a)} sequences, {tokens} reply tokens, longest {max(len(r['token_ids']) for r in a.values())}; "
          f"{args.b}: {len(b)} sequences, longest {max(len(r['token_ids']) for r in b.values())}")
    print(f"sequences longer in {args.b}: {len(longer)}; their reply differs: {len(changed)} {kinds}, "
          f"{changed_tokens} of {args.a}'s {tokens} reply tokens ({changed_tokens / tokens:.1%}); "
          f"other sequences with a different reply: "
          f"{sum(reply(a[k]) != reply(b[k]) for k in a if k in b and k not in longer)}")
    for kind in sorted({r["kind"] for r in a.values()}):
        total = sum(len(reply(r)) for r in a.values() if r["kind"] == kind)
        part = sum(len(reply(a[k])) for k in changed if a[k]["kind"] == kind)
        print(f"  {kind}: {part} of {total} reply tokens change ({part / total:.1%})")


def cmd_ship(args: argparse.Namespace) -> None:
    """Replace the shipped drafter with a candidate's checkpoint; its model card gets the search."""
    import shutil

    src, dst = ROOT / args.name / "model", REPO / args.dest
    table = Path(args.table).read_text()
    shutil.rmtree(dst)
    shutil.copytree(src, dst)
    card = dst / "README.md"
    head = card.read_text().split("\n## How this configuration was chosen\n")[0]  # a shipped card's old one goes
    extra = "".join("\n" + Path(t).read_text() for t in args.extra_table)
    card.write_text(head + "\n## How this configuration was chosen\n\n" + args.why.strip() + "\n\n" + table + extra)
    print(f"{src} -> {dst}")


def cmd_report(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
    budget = sum(sum(r["train_s"].values()) for r in rows)
    lines = [
        "| candidate | settings | epochs t/kl/st | train s (t/kl/st) | val tau | agentic | code | chat "
        "| acceptance 1..7 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: -r["val_tau"]):
        e, s, k = r["epochs"], r["train_s"], r["val_tau_by_kind"]
        lines.append(
            f"| {r['name']} | {' '.join(r['sets'])} | {e.get('teacher')}/{e.get('kl')}/{e.get('stable')} "
            f"| {sum(s.values()):.0f} ({'/'.join(f'{v:.0f}' for v in s.values())}) | {r['val_tau']:.3f} "
            + "".join(f"| {k[kind]:.2f} " if kind in k else "| - " for kind in ("agentic", "code", "chat"))
            + f"| {' '.join(f'{a:.2f}' for a in r['val_acceptance'])} |")
    v = rows[0].get("validation")
    lines.append(f"\nValidation: {v['kinds']} {v['split']}-split sessions of seed {v['seed']}, prompts <= "
                 f"{v['max_prompt_tokens']} tokens, {v['max_requests_per_kind']} requests per kind at most."
                 if v else f"\nTraining time, all candidates: {budget:.0f} s (one thread each).")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.name or "search"
        (out / f"{stem}.json").write_text(json.dumps(dict(rows=rows, train_s_total=budget,
                                                           validation=rows[0].get("validation") or validation()),
                                                      indent=1) + "\n")
        (out / ("table.md" if stem == "search" else f"{stem}.md")).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--data", default="base", help="regenerated data set under runs/search/ (default base)")
    r.add_argument("candidates", nargs="+", metavar='NAME="key=value ..."')
    e = sub.add_parser("eval")
    e.add_argument("drafters", nargs="+", metavar="NAME=PATH")
    e.add_argument("--note", default="(trained earlier on its own regeneration of the same recipe)")
    e.add_argument("--kinds", help='JSON, e.g. \'{"agentic": 8}\' (default: the config\'s eval.kinds)')
    e.add_argument("--max-prompt-tokens", type=int)
    e.add_argument("--results", default=str(RESULTS))
    sub.add_parser("overlap")
    c = sub.add_parser("compare-data")
    c.add_argument("a", help="a data set under runs/search/ (e.g. base)")
    c.add_argument("b", help="another regeneration of the same sessions (e.g. long)")
    sh = sub.add_parser("ship")
    sh.add_argument("name")
    sh.add_argument("--dest", default="models/dlite-qwen3-tiny-stdlib")
    sh.add_argument("--table", default="benchmarks/results/dlite-search/table.md")
    sh.add_argument("--why", required=True, help="a paragraph: the budget, the machine, the choice")
    sh.add_argument("--extra-table", action="append", default=[], help="more tables for the card (e.g. a long eval)")
    p = sub.add_parser("report")
    p.add_argument("--out")
    p.add_argument("--results", default=str(RESULTS), help="rows to report (e.g. eval --results ...)")
    p.add_argument("--name", help="file stem under --out (default: search.json and table.md)")
    args = ap.parse_args()
    {"run": cmd_run, "eval": cmd_eval, "overlap": cmd_overlap, "compare-data": cmd_compare_data, "ship": cmd_ship,
     "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
