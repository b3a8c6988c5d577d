"""Baseline drafters for the A/B benchmark: EAGLE-3, DFlash and DSpark trained with
``speculators==0.9.0`` (vLLM's drafter-training library), on CPU or GPU, from the SAME
target-regenerated data as DLite.

Pipeline (``python -m lab.baselines --method eagle3|dflash|dspark ...``):

1. **Sequences** (:mod:`lab.baselines.features`): the regenerated JSONL of
   :mod:`vllm_dlite.train.data` (prompt + the target's own greedy answer), read through
   :class:`~vllm_dlite.train.sequences.SequenceStore` exactly as DLite's trainer reads it
   (sequences longer than ``--max-len`` keep their LAST tokens; sequences with at least one
   anchor). Each becomes one speculators row ``(input_ids, loss_mask)`` with
   ``loss_mask = 1`` on the response tokens; rows get a fixed shuffle (speculators validates on
   the table's tail, ``--train-data-ratio`` 0.98).
2. **Features** (one shared store for every method, :mod:`lab.baselines.features`):
   the frozen HF target (:class:`~vllm_dlite.train.features.TargetFeatureExtractor`, vLLM's
   aux-id convention) writes ``hs_{i}.safetensors`` for sequence ``i`` of the store with
   :func:`~vllm_dlite.train.features.write_hs_file`, holding every layer a method may read
   (default ids ``1..N``, bfloat16: 6 KB per token for the 12-layer target), plus the
   speculators ``datasets`` table. vLLM's extraction connector is CUDA-only, hence HF. The store
   is written once and resumable; ``--reuse-features`` reads DLite's own feature files (same
   naming) instead of recomputing them.
3. **Training**: speculators' own trainer (``speculators.train.cli.main``) runs in-process; on a
   machine without an accelerator with the CPU-safe settings (``--draft-attn-impl sdpa --loss-implementation eager --num-workers 0
   --hidden-states-dtype float32``) and
   :func:`~lab.baselines.patches.cpu_safe_speculators`, which patches the few
   accelerator-only calls of its trainer at runtime (nothing in site-packages is edited). Each
   method reads its own layers out of the shared store through the hidden-states backend
   ``dlite_layers`` (:mod:`lab.baselines.patches`; speculators' backend plugin
   interface). All of it is fp32 on CPU (drafter, the frozen target copies, hidden states, loss,
   optimizer). Cost on the 2-core CPU (one thread, a step = 4,096 packed tokens of the tiny
   target, CPU seconds, the median of steps 2-7): DFlash block 8 1.55 s, EAGLE-3 9.2 s with 7
   TTT steps and 3.9 s with 3, i.e. ~6 / ~36 / ~15 min an epoch of 236 steps; 4.8 s and 30.6 s
   (DFlash, EAGLE-3 7 steps) before the tile-sparse attention and heap reuse of
   :func:`~lab.baselines.patches.cpu_safe_speculators`.
4. **Export**: the last epoch's checkpoint is copied to ``--out`` (``config.json`` +
   ``model.safetensors``, bf16) WITHOUT the frozen copies of the target's ``embed_tokens`` /
   ``lm_head`` (vLLM then shares the target's, exactly what it does for DLite), plus a README.
   ``LLM(target, speculative_config={"method": "eagle3"|"dflash", "model": out,
   "num_speculative_tokens": 7})`` loads it unchanged.

Layer ids (all in vLLM's aux-id convention, docs/design.md §2: id ``i`` = residual stream after
``i`` decoder layers, pre-norm; 0 = embeddings, N = after the last layer, before the final norm):

* speculators' ``--target-layer-ids`` ARE vLLM aux ids: EAGLE-3 stores them as
  ``eagle_aux_hidden_state_layer_ids`` (vLLM uses them as-is), DFlash/DSpark as
  ``aux_hidden_state_layer_ids`` (vLLM's speculators adapter passes them as-is to the model runner
  and as ``i - 1`` to ``dflash_config.target_layer_ids``, DFlash's "output of layer i" convention).
* speculators reads a hidden-state file as ``[aux layers..., id N]``: the last entry is the
  verifier's pre-norm last hidden state (teacher logits = ``lm_head(norm(h_N))``). The
  ``dlite_layers`` backend always appends id N, so N may also be an aux id (DFlash uses it, as
  DLite does).
* Defaults for an N-layer target: EAGLE-3 ``[2, N//2, N-1]`` (low/mid/high, N=12: ``[2, 6, 11]``);
  DFlash/DSpark: six evenly spaced aux ids ``round(linspace(1, N, 6))`` (N=12: ``[1, 3, 5, 8, 10, 12]``;
  the shipped baselines were trained with these).

Sizes (fair-comparison rule, docs/design.md §8): EAGLE-3 one decoder layer, DFlash/DSpark
``--num-layers 2`` (DLite's depth), width = target width, K = 7 speculative tokens: EAGLE-3
``ttt_steps = 7``; DFlash ``block_size = 8`` (anchor + 7 masks, the anchor is the bonus token);
DSpark ``block_size = 7`` with ``sample_from_anchor`` (its default; 7 positions predict 7 tokens,
DLite's block layout). DSpark is trainable here; vLLM 0.32 serves it only on Model Runner V2 (GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from .features import (
    FEATURES_META,
    METHODS,
    default_layer_ids,
    load_sequences,
    read_store_layer_ids,
    store_layer_ids,
    write_feature_store,
)
from .patches import cpu_safe_speculators, register_layer_backend

PathLike = Union[str, Path]

SERVABLE_ON_CPU = ("eagle3", "dflash")
K_DEFAULT = 7
SHARED_TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")


def _target_config(target: PathLike) -> dict:
    path = Path(target) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{target} has no config.json (is the target trained yet?)")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg)


def _mask_token_id(target: PathLike) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    if mask is None or mask == tok.unk_token_id:
        raise ValueError(
            f"the tokenizer of {target} has no mask token; DFlash/DSpark need one "
            "(pass --mask-token-id)"
        )
    return int(mask)


# =========================================================================== 3c. training
@dataclass
class BaselineRecipe:
    """One speculators run. Unset fields use the per-method defaults of this module."""

    method: str
    target: str
    features: str
    save_path: str
    epochs: int = 10
    layer_ids: Optional[list[int]] = None
    num_layers: Optional[int] = None  # eagle3: 1, dflash/dspark: 2
    num_speculative_tokens: int = K_DEFAULT
    ttt_steps: Optional[int] = None  # EAGLE-3 training-time-test steps (default K)
    lr: float = 1e-3
    optimizer: str = "muon"  # speculators' default
    total_seq_len: int = 4096
    max_anchors: int = 512
    markov_rank: int = 64  # DSpark (vocab x rank twice: 64 keeps it ~2 MB in bf16)
    max_steps: Optional[int] = None
    train_data_ratio: float = 0.98
    seed: int = 0
    log_freq: int = 10
    mask_token_id: Optional[int] = None
    extra: list[str] = field(default_factory=list)  # raw speculators flags, appended last

    def resolved_layer_ids(self) -> list[int]:
        n = int(_target_config(self.target)["num_hidden_layers"])
        ids = self.layer_ids or default_layer_ids(self.method, n)
        if sorted(set(ids)) != list(ids):
            raise ValueError(f"layer ids must be strictly increasing (vLLM sorts them): {ids}")
        if self.method == "eagle3" and len(ids) != 3:
            warnings.warn(f"EAGLE-3 is normally trained on 3 target layers, got {ids}",
                          stacklevel=2)
        return list(ids)


def speculators_argv(r: BaselineRecipe) -> list[str]:
    """The ``speculators train`` flags for a recipe (CPU-safe; also valid on GPU)."""
    if r.method not in METHODS:
        raise ValueError(f"unknown method {r.method!r}; choose one of {METHODS}")
    k = r.num_speculative_tokens
    num_layers = r.num_layers or (1 if r.method == "eagle3" else 2)
    argv = [
        "--speculator-type", r.method,
        "--verifier-name-or-path", str(r.target),
        "--data-path", str(r.features),
        "--save-path", str(r.save_path),
        "--log-dir", str(Path(r.save_path) / "logs"),
        "--hidden-states-backend", register_layer_backend(),
        "--target-layer-ids", *map(str, r.resolved_layer_ids()),
        "--num-layers", str(num_layers),
        "--epochs", str(r.epochs),
        "--lr", str(r.lr),
        "--optimizer", r.optimizer,
        "--total-seq-len", str(r.total_seq_len),
        "--train-data-ratio", str(r.train_data_ratio),
        "--seed", str(r.seed),
        "--log-freq", str(r.log_freq),
        "--on-missing", "raise",
    ]
    if not torch.accelerator.is_available():
        # CPU-safe settings (docs/design.md §8): no flex-attention backward and no fused
        # (Triton) loss on CPU, no spawned loader workers; fp32 compute (CPU autocast is bf16-only)
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
                 "--num-workers", "0", "--hidden-states-dtype", "float32"]
    if r.method == "eagle3":
        argv += ["--ttt-steps", str(r.ttt_steps or k)]
    else:
        mask = r.mask_token_id if r.mask_token_id is not None else _mask_token_id(r.target)
        # DFlash: anchor (bonus token) + K masks; DSpark samples from the anchor: K positions
        block = k + 1 if r.method == "dflash" else k
        argv += ["--block-size", str(block), "--max-anchors", str(r.max_anchors),
                 "--mask-token-id", str(mask)]
        if r.method == "dspark":
            argv += ["--markov-rank", str(r.markov_rank)]
    if r.max_steps is not None:
        argv += ["--max-steps", str(r.max_steps)]
    return argv + list(r.extra)


def run_speculators(argv: Sequence[str]) -> None:
    """Run speculators' trainer in this process (CPU-safe), like ``speculators train ARGV``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        if key in os.environ and not torch.accelerator.is_available():
            raise RuntimeError(f"{key} is set: distributed speculators training needs GPUs")
    register_layer_backend()
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(list(argv))
    with cpu_safe_speculators():
        speculators_main(cfg)


def last_checkpoint(save_path: PathLike, epochs: Optional[int] = None) -> Path:
    """The highest-numbered epoch directory speculators wrote under ``save_path``; with ``epochs``,
    only if it closes the run's last epoch (speculators returns normally after a SIGINT/SIGTERM too,
    and a half-trained drafter must not be exported as the finished one)."""
    numbered = [int(p.name) for p in Path(save_path).iterdir()
                if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    if not numbered:
        raise FileNotFoundError(f"no epoch checkpoint under {save_path}")
    last = Path(save_path) / str(max(numbered))
    if epochs is not None:
        state_path = last / "training_state.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        if max(numbered) < epochs - 1 or state.get("local_step", 0) > 0:
            raise SystemExit(
                f"speculators stopped before the end of epoch {epochs} (last checkpoint: epoch "
                f"{max(numbered) + 1}, step {state.get('local_step', 0)} of it): nothing exported; "
                "re-run the same command to resume")
    return last


# =========================================================================== 4. export
def export_checkpoint(src: PathLike, out: PathLike, target: PathLike, *,
                      dtype: torch.dtype = torch.bfloat16, readme: Optional[str] = None) -> Path:
    """Copy a speculators checkpoint to ``out`` as vLLM loads it, minus the target's weights.

    ``embed_tokens.weight`` / ``lm_head.weight`` are dropped when they are the (frozen) target
    tensors, so vLLM shares the target's (it does when a drafter checkpoint lacks them). Floating
    tensors are cast to ``dtype``. ``config.json`` is kept (speculators format), with the dtype
    field patched.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_dlite.train.features import TargetHead

    src, out = Path(src), Path(out)
    head = TargetHead.from_pretrained(target)
    shared = dict(zip(SHARED_TARGET_KEYS, (head.embed_weight, head.lm_head_weight)))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            ref = shared.get(name)
            if ref is not None and t.shape == ref.shape and torch.equal(t, ref.to(t.dtype)):
                continue
            tensors[name] = t.to(dtype) if t.is_floating_point() else t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = dtype_name
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if readme:
        (out / "README.md").write_text(readme)
    return out


def checkpoint_summary(path: PathLike) -> dict:
    """``{"params", "bytes", "tensors"}`` of an exported checkpoint."""
    from safetensors import safe_open

    path = Path(path)
    params, names = 0, []
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            numel = 1
            for dim in f.get_slice(name).get_shape():
                numel *= int(dim)
            params += numel
            names.append(name)
    return dict(params=params, bytes=(path / "model.safetensors").stat().st_size, tensors=names)


def vllm_speculative_config(method: str, model: PathLike, k: int = K_DEFAULT) -> dict:
    """The ``speculative_config`` that serves an exported baseline with vLLM."""
    if method == "dspark":
        warnings.warn("vLLM 0.32 serves DSpark only with Model Runner V2 (GPU)", stacklevel=2)
    return {"method": method, "model": str(model), "num_speculative_tokens": k}


# =========================================================================== CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lab.baselines",
        description="Train an EAGLE-3 / DFlash / DSpark baseline drafter with speculators==0.9.0 "
        "on the target-regenerated data (CPU-safe), and export a vLLM-loadable checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--method", required=True, choices=METHODS)
    ap.add_argument("--target", required=True, help="HF directory of the target (verifier)")
    ap.add_argument("--data", required=True,
                    help="regenerated sequences: the JSONL of `python -m vllm_dlite.train.data` "
                    "(or a directory holding exactly one)")
    ap.add_argument("--out", required=True, help="exported drafter directory (vLLM loads it)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--work-dir", default="runs/baselines",
                    help="speculators checkpoints go to WORK_DIR/<out name>/checkpoints")
    ap.add_argument("--features", default=None,
                    help="shared hidden-state store (default WORK_DIR/features-<target name>)")
    ap.add_argument("--features-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reuse-features", default=None, metavar="HS_DIR",
                    help="read existing hs_{i}.safetensors (i = sequence index of --data, the "
                    "same --max-len) from HS_DIR instead of recomputing them, e.g. DLite's "
                    "runs/dlite-qwen3-tiny-stdlib/data/features/hidden_states")
    ap.add_argument("--store-layer-ids", type=int, nargs="+", default=None,
                    help="layers kept in a NEW store (default: 1..N)")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None,
                    help="vLLM aux ids the drafter reads (default: see module docstring)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="draft decoder layers (default eagle3 1, dflash/dspark 2)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=K_DEFAULT)
    ap.add_argument("--max-len", type=int, default=4096,
                    help="keep the last MAX_LEN tokens of each sequence; also the packed batch "
                    "length (speculators --total-seq-len)")
    ap.add_argument("--max-sequences", type=int, default=None, help="use the first N sequences")
    ap.add_argument("--ttt-steps", type=int, default=None,
                    help="EAGLE-3 training-time-test steps (default K; 3 = speculators' default, "
                    "~3x cheaper on CPU)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    ap.add_argument("--max-anchors", type=int, default=512, help="DFlash/DSpark anchors per batch")
    ap.add_argument("--markov-rank", type=int, default=64, help="DSpark Markov head rank")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="DFlash/DSpark placeholder token (default: the tokenizer's <|mask|>)")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--train-data-ratio", type=float, default=0.98,
                    help="speculators keeps the rest (after a fixed shuffle) for validation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-freq", type=int, default=10)
    ap.add_argument("--fresh", action="store_true",
                    help="delete this run's speculators checkpoints first (default: resume)")
    ap.add_argument("--features-only", action="store_true", help="write the store and stop")
    ap.add_argument("--speculators-arg", action="append", default=[], metavar="FLAG",
                    help="extra raw `speculators train` flag (repeatable; use --speculators-arg=--x)")
    return ap


def main(argv: Optional[list[str]] = None) -> Path:
    args = build_parser().parse_args(argv)
    t_start = time.time()
    target = Path(args.target)
    n = int(_target_config(target)["num_hidden_layers"])
    work = Path(args.work_dir)
    features = Path(args.features) if args.features else work / f"features-{target.name}"
    out = Path(args.out)

    # 1-2. sequences and the shared feature store
    if (features / FEATURES_META).is_file() and args.store_layer_ids is None:
        store_ids = read_store_layer_ids(features)
    else:
        store_ids = sorted(set(args.store_layer_ids or store_layer_ids(n, [args.layer_ids or []]))
                           | {n})
    sequences = load_sequences(args.data, args.max_len)
    if args.max_sequences:
        sequences = sequences.select(range(min(args.max_sequences, len(sequences))))
    # fixed shuffle: the JSONL is grouped by workload kind, speculators' validation split is its tail
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
    sequences = sequences.select(order)
    print(f"[baselines] {len(sequences)} sequences, {sequences.num_tokens} tokens; "
          f"feature store {features} layers {store_ids}", flush=True)
    t0 = time.time()
    write_feature_store(target, sequences, features, store_ids,
                        dtype=getattr(torch, args.features_dtype), reuse=args.reuse_features,
                        source=str(args.data))
    t_features = time.time() - t0
    if args.features_only:
        return features

    # 3. speculators training
    recipe = BaselineRecipe(
        method=args.method, target=str(target), features=str(features),
        save_path=str(work / out.name / "checkpoints"), epochs=args.epochs,
        layer_ids=args.layer_ids, num_layers=args.num_layers,
        num_speculative_tokens=args.num_speculative_tokens, ttt_steps=args.ttt_steps, lr=args.lr,
        optimizer=args.optimizer, total_seq_len=args.max_len, max_anchors=args.max_anchors,
        markov_rank=args.markov_rank, max_steps=args.max_steps,
        train_data_ratio=args.train_data_ratio, seed=args.seed, log_freq=args.log_freq,
        mask_token_id=args.mask_token_id, extra=list(args.speculators_arg),
    )
    missing = [i for i in recipe.resolved_layer_ids() if i not in store_ids]
    if missing:
        raise ValueError(f"layer ids {missing} are not in the feature store {features} "
                         f"(holds {store_ids}); pass --store-layer-ids with a new --features dir")
    if args.fresh and Path(recipe.save_path).exists():
        shutil.rmtree(recipe.save_path)
    spec_argv = speculators_argv(recipe)
    print("[baselines] speculators train " + shlex.join(spec_argv), flush=True)
    t0 = time.time()
    run_speculators(spec_argv)
    t_train = time.time() - t0

    # 4. export
    src = last_checkpoint(recipe.save_path, recipe.epochs)
    cmd = shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "lab.baselines",
                      *(argv if argv is not None else sys.argv[1:])])
    readme = _readme(args.method, recipe, spec_argv, cmd, len(sequences), sequences.num_tokens,
                     t_features, t_train, src)
    export_checkpoint(src, out, target, readme=readme)
    info = checkpoint_summary(out)
    print(f"[baselines] {args.method} -> {out} ({info['params'] / 1e6:.2f}M params, "
          f"{info['bytes'] / 2**20:.2f} MiB), total {time.time() - t_start:.0f}s", flush=True)
    return out


def _readme(method, recipe, spec_argv, cmd, n_seq, n_tok, t_features, t_train, src) -> str:
    serve = json.dumps(vllm_speculative_config(method, "<this dir>", recipe.num_speculative_tokens)
                       ) if method in SERVABLE_ON_CPU else (
        '{"method": "dspark", ...}: vLLM 0.32 serves DSpark on Model Runner V2 (GPU) only')
    return f"""# {method} baseline drafter for {Path(recipe.target).name}

Trained with speculators==0.9.0 (vLLM's drafter-training library) on the target-regenerated data
(same sequences as DLite), exported by `lab.baselines`. The target's embed_tokens and
lm_head are not stored: vLLM shares the target's.

- command: `{cmd}`
- speculators: `speculators train {shlex.join(spec_argv)}`
- target layers (vLLM aux ids, residual after i layers, pre-norm): {recipe.resolved_layer_ids()}
- data: {n_seq} sequences, {n_tok} tokens; features {t_features:.0f}s, training {t_train:.0f}s
  (device: {"cuda" if torch.cuda.is_available() else "cpu"}), checkpoint {src.name}
- serve: `LLM(target, speculative_config={serve})`
"""



__all__ = [
    "BaselineRecipe",
    "export_checkpoint",
    "last_checkpoint",
    "main",
    "run_speculators",
    "speculators_argv",
    "vllm_speculative_config",
]
