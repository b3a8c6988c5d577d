"""One command to train a DLite drafter.

    python -m vllm_dlite.train --target PATH/TO/HF_MODEL --out DIR

trains a ``dlite_v1`` drafter for a local HF Qwen3-style model with the authors' recipe
(``docs/dlite_v1.md`` §6): regenerate on-policy data with vLLM (training-split
agentic/code/chat workloads), pick L = 14/36 of the target layers by the authors' rule
(``build_target_layer_ids``), train the sliding-window teacher (8 epochs) -> stage 1 KL from
the teacher with its head frozen in the student (2) -> stage 2 CE + TV against the target (6),
write ``DIR/config.json`` + ``DIR/model.safetensors``. Working files (data, features,
checkpoints, metrics) go to ``runs/<DIR name>`` (``--work-dir``). Re-running the same command
resumes from the latest checkpoint.

    python -m vllm_dlite.train --config configs/dlite-tiny.yaml [--set optim.lr=3e-4 ...]
    torchrun --nproc-per-node 8 -m vllm_dlite.train --config cfg.yaml      # DDP (nccl / gloo)

Config files are YAML or JSON with the sections of :class:`vllm_dlite.train.config.TrainConfig`
(``target``, ``data``, ``model``, ``epochs``, ``optim``, ``loss``, ``run``, ``ablation``,
``eval``); ``--set a.b=VALUE`` overrides any key (VALUE parsed as YAML). Ablations:
``--ablation stable_only`` (skip teacher + stage 1), ``--ablation anchor_group_size=2``,
``--ablation sequential_rank=64`` (any ``model.*`` key works as ``key=value``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from vllm_dlite.train.config import TrainConfig
from vllm_dlite.train.trainer import Trainer

ABLATION_FLAGS = {"stable_only": ("ablation", "stable_only")}


def load_config_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith(".json"):
        return json.loads(text)
    import yaml

    return yaml.safe_load(text) or {}


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def set_dotted(config: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = config
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {key} is not a section")
    node[keys[-1]] = value


def apply_ablation(config: dict[str, Any], spec: str) -> None:
    name, _, value = spec.replace("-", "_").partition("=")
    if name in ABLATION_FLAGS and not value:
        set_dotted(config, ".".join(ABLATION_FLAGS[name]), True)
    elif value:
        set_dotted(config, f"model.{name}", _parse_value(value))
    else:
        raise ValueError(
            f"--ablation {spec!r}: use stable_only, anchor_group_size=2, sequential_rank=N, or any "
            "model.* key as key=value"
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dlite.train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="YAML or JSON config file")
    ap.add_argument("--target", help="HF directory of the target model (target.path)")
    ap.add_argument("--out", help="output drafter directory (run.out)")
    ap.add_argument("--work-dir", help="working directory (run.work_dir)")
    ap.add_argument("--sequences", help="use this regenerated JSONL (data.sequences)")
    ap.add_argument("--resume", help="auto (default) | none | CHECKPOINT_DIR (run.resume)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set data.anchors_per_seq=64")
    ap.add_argument("--ablation", action="append", default=[], metavar="NAME[=VALUE]",
                    help="stable_only | anchor_group_size=2 | sequential_rank=N | <model key>=VALUE")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config as JSON and exit")
    ap.add_argument("--only-data", action="store_true",
                    help="regenerate the training data (vLLM) and exit")
    return ap


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    config: dict[str, Any] = load_config_file(args.config) if args.config else {}
    for flag, key in (("target", "target.path"), ("out", "run.out"),
                      ("work_dir", "run.work_dir"), ("sequences", "data.sequences"),
                      ("resume", "run.resume")):
        if getattr(args, flag):
            set_dotted(config, key, getattr(args, flag))
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        set_dotted(config, key.strip(), _parse_value(value))
    for spec in args.ablation:
        apply_ablation(config, spec)
    return TrainConfig.from_dict(config)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        if args.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        cfg.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.only_data:
        from vllm_dlite.train.data import regenerate_in_subprocess, regeneration_done

        trainer = Trainer(cfg)
        path, regen = trainer._sequences_path(), trainer.regeneration_config()
        if not regeneration_done(path, cfg.target.path, regen):
            path.parent.mkdir(parents=True, exist_ok=True)
            regenerate_in_subprocess(cfg.target.path, path, regen)
        print(f"training data: {path}")
        return 0
    Trainer(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
