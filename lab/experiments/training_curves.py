#!/usr/bin/env python3
"""Training curves of the A/B drafters, side by side: loss and per-position accuracy against the
fraction of the training budget used.

    .venv/bin/python lab/experiments/training_curves.py \\
        --speculators eagle3=runs/baselines/train-eagle3.log dflash=runs/baselines/train-dflash.log \\
        --dlite "dlite 1 epoch=runs/dlite-1epoch/work/metrics.jsonl" \\
                "dlite 6 epochs=models/dlite-qwen3-tiny-stdlib/metrics.jsonl" \\
        --out benchmarks/results/training-curves

Sources: speculators' trainer prints its metrics to the console (``train/<name>=<value>`` fields,
one block per logged step, closed by ``global_step=N``), so ``--speculators`` reads that log;
DLite's trainer writes ``metrics.jsonl`` (one JSON per logged step, ``acc`` = per-position accuracy).

The accuracies are each trainer's own, on its own training batches, and are NOT the same quantity:
DFlash ``position_k_acc`` and DLite ``acc[k]`` are teacher-forced per-position accuracies of a
block; EAGLE-3 ``full_acc_k`` is the share of positions whose first k+1 test-time-training steps are
all right. The comparable figure is vLLM's acceptance per position (``benchmarks/ab.py``).
The speculators logs also give the held-out loss at the end of each epoch (``val_by_epoch``; DLite's
trainer measures none). Writes ``OUT/curves.json`` and, with matplotlib, ``OUT/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

FIELD = re.compile(r"([\w/]+)=([-+0-9.eE]+|nan)")


def read_speculators_log(path: Path) -> list[dict]:
    """Logged training steps of a speculators console log: ``{"step", "loss", "acc": [...]}``."""
    rows, block = [], {}
    for line in path.read_text(errors="replace").splitlines():
        for key, value in FIELD.findall(line):
            block[key] = float(value)
        if "global_step" in block:
            if "train/loss" in block:
                accs = sorted((int(m.group(1)), v) for k, v in block.items()
                              if (m := re.fullmatch(r"train/(?:position_|full_acc_)(\d+)(?:_acc)?", k)))
                rows.append({"step": int(block["global_step"]), "loss": block["train/loss"],
                             "acc": [v for _, v in accs]})
            block = {}
    return rows


def read_speculators_val(path: Path) -> list[dict]:
    """Held-out loss per epoch of a speculators console log (``val/loss_epoch=..``, ``epoch=N``):
    speculators keeps ``--train-data-ratio``'s remainder of the sequences for it."""
    rows, block = [], {}
    for line in path.read_text(errors="replace").splitlines():
        for key, value in FIELD.findall(line):
            block[key] = float(value)
        if "val/loss_epoch" in block and "epoch" in block:
            rows.append({"epoch": int(block["epoch"]) + 1, "val_loss": block["val/loss_epoch"]})
            block = {}
        elif "global_step" in block:
            block = {}
    return rows


def read_dlite_metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "loss": r["loss"], "acc": r["acc"]} for r in rows if "acc" in r]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculators", nargs="*", default=[], metavar="NAME=LOG")
    ap.add_argument("--dlite", nargs="*", default=[], metavar="NAME=METRICS_JSONL")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    curves = {}
    for specs, reader in ((args.speculators, read_speculators_log), (args.dlite, read_dlite_metrics)):
        for spec in specs:
            name, _, path = spec.partition("=")
            if not path or not Path(path).is_file():
                ap.error(f"{spec!r}: expected NAME=PATH to an existing file")
            rows = reader(Path(path))
            if not rows:
                ap.error(f"{path}: no logged training steps found")
            val = read_speculators_val(Path(path)) if reader is read_speculators_log else []
            curves[name] = {"source": path, "steps": rows[-1]["step"], "rows": rows, "val_by_epoch": val}
            last = rows[-1]
            print(f"{name}: {len(rows)} logged steps up to {last['step']}, last loss {last['loss']:.3f}, "
                  f"acc {' '.join(f'{a:.2f}' for a in last['acc'])}"
                  + ("; held-out loss by epoch " + " ".join(f"{v['val_loss']:.3f}" for v in val) if val else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curves.json").write_text(json.dumps(curves, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return 0
    fig, (ax_loss, ax_acc, ax_val) = plt.subplots(1, 3, figsize=(16, 4))
    for name, c in curves.items():
        x = [r["step"] / c["steps"] for r in c["rows"]]
        ax_loss.plot(x, [r["loss"] for r in c["rows"]], label=name)
        ax_acc.plot(x, [r["acc"][0] if r["acc"] else float("nan") for r in c["rows"]], label=name)
        if c["val_by_epoch"]:
            ax_val.plot([v["epoch"] for v in c["val_by_epoch"]], [v["val_loss"] for v in c["val_by_epoch"]],
                        marker="o", label=name)
    ax_loss.set(xlabel="fraction of the run", ylabel="training loss (each method's own)", yscale="log")
    ax_acc.set(xlabel="fraction of the run", ylabel="position-1 accuracy on training batches")
    ax_val.set(xlabel="epoch", ylabel="held-out loss (speculators' validation split)", yscale="log")
    ax_acc.legend()
    ax_val.legend()
    fig.tight_layout()
    fig.savefig(args.out / "curves.png", dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
