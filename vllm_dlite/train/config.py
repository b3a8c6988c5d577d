"""Training configuration of :mod:`vllm_dlite.train` (format ``dlite_v1``): the section dataclasses
(``target``, ``data``, ``model``, ``epochs``, ``optim``, ``loss``, ``run``, ``ablation``, ``eval``)
of :class:`TrainConfig`, their defaults (the authors' recipe where published), and strict loading
from a plain mapping (a parsed YAML/JSON file: unknown keys raise, numbers are coerced by the
field's annotation, ``epochs`` merges over the paper's 8 / 2 / 6) plus :meth:`TrainConfig.validate`.
Plain data: nothing here touches a model, a device or a file (:meth:`TrainConfig.work_dir` only
names a path); the stage loop that consumes it is :mod:`vllm_dlite.train.trainer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from vllm_dlite.model.teacher import DEFAULT_WINDOW
from vllm_dlite.train import losses
from vllm_dlite.train.data import RegenerationConfig
from vllm_dlite.train.workloads.generator import split_name

STAGES = ("teacher", "kl", "stable")
PAPER_EPOCHS = {"teacher": 8, "kl": 2, "stable": 6}
# model.* keys renamed to the DLiteConfig fields they set (the training_report.json of
# models/dlite-qwen3-tiny-stdlib still shows the old names): refused with the new name
RENAMED_MODEL_KEYS = {"num_layers": "num_hidden_layers", "head_rank": "sequential_rank"}


@dataclass
class TargetSection:
    path: str = ""  # HF model directory of the frozen target
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype on GPU
    attn_implementation: str = "sdpa"


@dataclass
class DataSection:
    sequences: Optional[str] = None  # regenerated JSONL; None -> {work_dir}/data/sequences.jsonl
    # regeneration settings; its max_len is always taken from data.max_len below
    regenerate: RegenerationConfig = field(default_factory=RegenerationConfig)
    max_len: int = 4096  # prompt + response cap (paper: 4096); longer sequences keep the tail
    anchors_per_seq: Optional[int] = 512  # per sequence and epoch (authors: 512); 0/None = all
    max_tokens_per_batch: int = 16384  # per rank and micro-batch, padded tokens
    max_seqs_per_batch: int = 16
    feature_source: str = "online"  # online | files
    features_dir: Optional[str] = None  # files mode; None -> {work_dir}/data/features_v1
    features_dtype: str = "bfloat16"  # dtype of written feature files


@dataclass
class ModelSection:
    num_feature_layers: Optional[int] = None  # L; None: min(N, 14/36 N) (paper: 14 of 36)
    block_size: int = 8  # B, counting the anchor: K = B-1 drafted tokens
    anchor_group_size: int = 1  # G: 1 (anchor only) or 2 (x_{a-1}, x_a; primes the head)
    # block_size, anchor_group_size, num_hidden_layers, sequential_rank and mask_token_id are the
    # DLiteConfig fields of the same names (None: the DLiteConfig.for_target default)
    num_hidden_layers: Optional[int] = None  # draft depth n; None: round(0.14 N)
    sequential_rank: Optional[int] = None  # head rank r; None: hidden_size // 8
    mask_token_id: Optional[int] = None  # None: tokenizer's mask token / <|mask|> / padded id
    teacher_window: int = DEFAULT_WINDOW  # W: the teacher sees W-1 fused history slots
    teacher_history_layer_ids: Optional[list[int]] = None  # None: [0, N//2, N-1] (0-based)
    # initialisation of the sequential head of a model trained from scratch (the teacher; the
    # student when there is no teacher): "target_svd" = the rank-r truncated SVD of the target's
    # lm_head split over output_proj and the d-columns of state_hidden_mlp (logits start as
    # lm_head_r(d)); "random" = N(0, 0.02). The authors' initialisation is not published.
    head_init: str = "target_svd"
    init_from: Optional[str] = None  # start the student from an existing dlite_v1 checkpoint
    dlite_overrides: dict[str, Any] = field(default_factory=dict)  # any other DLiteConfig field


@dataclass
class OptimSection:
    lr: float = 6e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum_steps: int = 1
    # forward/backward the anchors of a micro-batch in chunks of this size (0 = one chunk): bounds
    # the [N, K, V] logits memory and the teacher's packed attention (~ anchors per sequence ^ 2);
    # the gradient is the same (chunk losses are weighted by their share of the denominators)
    anchor_chunk_size: int = 128


@dataclass
class LossSection:
    gamma: float = losses.DEFAULT_GAMMA  # w_k = exp(-k / gamma), k 0-based
    stable_ce_weight: float = losses.STABLE_CE_WEIGHT  # lambda_CE (paper 0.1)
    stable_tv_weight: float = losses.STABLE_TV_WEIGHT  # lambda_TV (paper 1)
    teacher_position_weights: bool = True  # teacher CE weighted by w_k too (else uniform)


@dataclass
class RunSection:
    out: str = ""  # final drafter checkpoint directory
    work_dir: Optional[str] = None  # None -> runs/<basename of out>
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32
    parallel: str = "ddp"  # ddp | fsdp
    threads: int = 0  # torch intra-op threads per rank (0: torch default)
    log_every: int = 10
    checkpoint_every: int = 500  # optimizer steps (0: only at stage ends)
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto (latest in work_dir) | none | path of a checkpoint directory
    progress: bool = True
    tensorboard: bool = True
    export_dtype: str = "auto"  # dtype of the exported drafter; auto = the target's
    max_steps_per_stage: Optional[int] = None  # cap (smoke runs, timing)
    stage_time_budget_s: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    stop_after_steps: Optional[int] = None  # checkpoint and stop at this global step (tests)


@dataclass
class AblationSection:
    stable_only: bool = False  # skip teacher + stage 1 (paper's single-stage baseline)


@dataclass
class EvalSection:
    """Offline acceptance estimate after training (rank 0; empty kinds = skipped)."""

    kinds: dict[str, int] = field(default_factory=dict)  # generated sessions per kind
    split: str = "heldout"  # of those sessions: heldout, or train with a seed the data did not use
    workloads: list[str] = field(default_factory=list)  # or workload JSONL files
    max_requests_per_kind: int = 8
    max_new_tokens: int = 128
    max_prompt_tokens: Optional[int] = 8192
    seed: int = 1


@dataclass
class TrainConfig:
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    epochs: dict[str, int] = field(default_factory=lambda: dict(PAPER_EPOCHS))
    optim: OptimSection = field(default_factory=OptimSection)
    loss: LossSection = field(default_factory=LossSection)
    run: RunSection = field(default_factory=RunSection)
    ablation: AblationSection = field(default_factory=AblationSection)
    eval: EvalSection = field(default_factory=EvalSection)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Strict: unknown keys raise ``ValueError`` naming the section and the known keys.
        ``epochs`` is merged over the paper's defaults (stages not named keep 8 / 2 / 6); the
        earlier stage name ``warmup`` is read as ``kl``; the renamed ``model.*`` keys
        (:data:`RENAMED_MODEL_KEYS`) are refused with their new names."""
        data = dict(data or {})
        model = data.get("model")
        renamed = sorted(set(model) & set(RENAMED_MODEL_KEYS)) if isinstance(model, dict) else []
        if renamed:
            raise ValueError("config: " + "; ".join(f"model.{k} is now model.{RENAMED_MODEL_KEYS[k]}" for k in renamed)
                             + " (the DLiteConfig fields they set)")
        if isinstance(data.get("epochs"), dict):
            epochs = dict(data["epochs"])
            if "warmup" in epochs:
                epochs.setdefault("kl", epochs.pop("warmup"))
            data["epochs"] = {**PAPER_EPOCHS, **epochs}
        return _build_dataclass(cls, data, "config")

    def validate(self) -> "TrainConfig":
        if not self.target.path:
            raise ValueError("target.path is required (the HF directory of the target model)")
        if not self.run.out:
            raise ValueError("run.out is required (where the drafter checkpoint is written)")
        unknown = sorted(set(self.epochs) - set(STAGES))
        if unknown:
            raise ValueError(f"epochs has unknown stages {unknown}; stages are {list(STAGES)}")
        for stage in STAGES:
            self.epochs.setdefault(stage, 0)
            if int(self.epochs[stage]) < 0:
                raise ValueError(f"epochs.{stage} must be >= 0")
        stages = self.stages()
        if not stages:
            raise ValueError("nothing to train: every stage has 0 epochs")
        if "kl" in stages and "teacher" not in stages:
            raise ValueError(
                "epochs.kl > 0 needs a trained teacher (epochs.teacher > 0); set "
                "epochs.kl: 0 or use --ablation stable_only"
            )
        if self.model.anchor_group_size < 1:
            raise ValueError("model.anchor_group_size must be >= 1")
        if self.model.head_init not in ("target_svd", "random"):
            raise ValueError("model.head_init must be 'target_svd' or 'random'")
        unknown = sorted(set(self.run.stage_time_budget_s) - set(STAGES))
        if unknown:
            raise ValueError(f"run.stage_time_budget_s has unknown stages {unknown}")
        if self.data.feature_source not in ("online", "files"):
            raise ValueError("data.feature_source must be 'online' or 'files'")
        if self.run.parallel not in ("ddp", "fsdp"):
            raise ValueError("run.parallel must be 'ddp' or 'fsdp'")
        if self.run.precision not in ("auto", "bf16", "fp32"):
            raise ValueError("run.precision must be auto, bf16 or fp32")
        if self.optim.grad_accum_steps < 1:
            raise ValueError("optim.grad_accum_steps must be >= 1")
        if self.eval.kinds and self.eval.split not in ("train", "heldout"):
            raise ValueError(f"eval.split must be 'train' or 'heldout', got {self.eval.split!r}")
        regen = self.data.regenerate
        for name in list(regen.kinds) + list(self.eval.kinds):
            try:
                split_name(name)
            except ValueError as e:
                raise ValueError(f"data.regenerate.kinds / eval.kinds: {name!r}: {e}") from None
        if self.eval.kinds and self.eval.split == regen.split and self.eval.seed == regen.seed:
            raise ValueError(
                f"eval.kinds would evaluate on the training sessions (split {regen.split!r}, seed "
                f"{regen.seed}, as data.regenerate): set eval.seed to a seed the data did not use "
                "(a validation split) or eval.split: heldout"
            )
        return self

    def stages(self) -> list[str]:
        chosen = ["stable"] if self.ablation.stable_only else list(STAGES)
        return [s for s in chosen if int(self.epochs.get(s, 0)) > 0]

    def work_dir(self) -> Path:
        if self.run.work_dir:
            return Path(self.run.work_dir)
        return Path("runs") / Path(self.run.out).resolve().name


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """YAML 1.1 reads ``3e-4`` as a string: coerce numbers by the field's annotation."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    if isinstance(value, str) and base in (float, int):
        try:
            return base(float(value)) if base is int and "." not in value else base(value)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _build_dataclass(cls: type, data: Any, where: str) -> Any:
    import typing

    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known keys: {sorted(fields)}")
    values = {}
    for name, value in data.items():
        f = fields[name]
        default = (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        )
        if dataclasses.is_dataclass(default) and not isinstance(value, type(default)):
            value = _build_dataclass(type(default), value or {}, f"{where}.{name}")
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(float(v) for v in value)
        else:
            value = _coerce(value, hints.get(name), f"{where}.{name}")
        values[name] = value
    return cls(**values)


__all__ = [
    "PAPER_EPOCHS",
    "RENAMED_MODEL_KEYS",
    "STAGES",
    "TrainConfig",
]
