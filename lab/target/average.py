"""Average the weights of targets fine-tuned from one another (weight-space ensembling).

    .venv/bin/python -m lab.target.average runs/target-docstring2/model runs/target-docstring3/model \
        --out runs/target-docstring23/model

Two stages of the long recipe can trade one skill for another (stage 3 writes more 16k-32k
docstrings than stage 2, and fewer well-formed tool calls); their mean often keeps both. Every
tensor of ``model.safetensors`` is averaged in fp32 and stored in its own dtype; the first
directory's other files (config, tokenizer, template) are copied and ``training_report.json``
gets an ``average`` stage naming the sources. The sources must share every tensor name and shape.
"""

import argparse
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from lab.target.sft import append_stage

WEIGHTS = "model.safetensors"


def average(sources: list[Path], out: Path) -> None:
    states = [load_file(str(src / WEIGHTS)) for src in sources]
    shapes = [{k: v.shape for k, v in state.items()} for state in states]
    for src, other in zip(sources[1:], shapes[1:]):
        differ = sorted(k for k in shapes[0].keys() | other.keys() if shapes[0].get(k) != other.get(k))
        if differ:
            raise SystemExit(f"error: {src} does not match {sources[0]} tensor for tensor "
                             f"(first: {differ[:3]}): average targets of one architecture")
    mean = {k: (sum(s[k].float() for s in states) / len(states)).to(t.dtype).contiguous()
            for k, t in states[0].items()}
    out.mkdir(parents=True, exist_ok=True)
    for f in sources[0].iterdir():
        if f.is_file() and f.name != WEIGHTS and (out / f.name).resolve() != f.resolve():
            shutil.copy2(f, out / f.name)
    save_file(mean, str(out / WEIGHTS), metadata={"format": "pt"})
    append_stage(out, {"stage": "average", "sources": [str(s) for s in sources], "training_tokens": 0,
                       "train_wall_s": 0, "command": "python -m lab.target.average " + " ".join(sys.argv[1:])})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", type=Path, help="target directories (at least two)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if len(args.sources) < 2:
        ap.error("give at least two target directories to average")
    for src in args.sources:
        if not (src / WEIGHTS).exists():
            ap.error(f"{src / WEIGHTS} is missing: give trained target directories")
    average(args.sources, args.out)


if __name__ == "__main__":
    main()
