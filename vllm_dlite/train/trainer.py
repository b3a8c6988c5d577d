"""DLite drafter training: teacher -> warm-up -> stable (paper Sec. 4.2, App. A.1; DESIGN.md 2).

Stages (each its own AdamW + warm-up/cosine schedule; epochs default to the paper's 8 / 2 / 6):

* ``teacher``: the history-aware :class:`~vllm_dlite.model.HistoryTeacher` trained with token CE.
* ``warmup``:  DLite (initialised from the teacher's shared weights unless
  ``model.init_drafter_from_teacher: false``) trained with the position-weighted forward KL from
  the frozen teacher.
* ``stable``:  teacher removed; ``0.1 * CE + 1.0 * sum_i w_i ||p^T_i - q_i||_1`` where ``p^T`` is
  the frozen target's own next-token distribution.
  Loss averaging is documented in :mod:`vllm_dlite.train.losses`.

Target features are computed ONLINE by the frozen target in every step (``data.feature_source:
online``, the paper's setting), or read from speculators-format ``hs_*.safetensors`` files written
once by this pipeline (``files``: cheaper for many epochs on small hardware, ~``2*L*H`` bytes per
token on disk).

Scale-out: ``torchrun --nproc-per-node G -m vllm_dlite.train ...``; gloo on CPU, nccl on GPU;
``run.parallel: ddp`` (default) or ``fsdp`` (FSDP2 ``fully_shard`` of the trainable model: shards
its parameters, gradients and optimizer states; for drafters of large targets). Every rank holds
its own frozen target copy (bf16 on GPU). bf16 autocast on GPU (``run.precision``).

Exact resume: checkpoints (``run.checkpoint_every`` optimizer steps, and at the end of every stage)
hold both models, the optimizer, the scheduler, every rank's RNG states and the data position
(stage, epoch, step). Data order and anchor sampling are pure functions of ``(seed, stage, epoch,
sequence)``, so a resumed run replays exactly the uninterrupted loss curve (same world size and
thread count; GPU kernels may add their own non-determinism).

Outputs: ``run.out`` receives the drafter checkpoint (``config.json`` + ``model.safetensors``,
loadable by :func:`vllm_dlite.model.load_drafter` and vLLM), ``README.md`` and
``training_report.json``; ``run.work_dir`` holds the regenerated data, feature files, the
teacher, checkpoints, ``metrics.jsonl`` and TensorBoard events (if TensorBoard is installed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vllm_dlite.config import DLiteConfig
from vllm_dlite.model import DLiteDrafter, HistoryTeacher
from vllm_dlite.train import losses
from vllm_dlite.train.data import (
    RegenerationConfig,
    SequenceBatch,
    SequenceStore,
    collate,
    plan_batches,
    regenerate_in_subprocess,
    regeneration_done,
)
from vllm_dlite.train.features import (
    HS_DIRNAME,
    TargetFeatureExtractor,
    TargetHead,
    hs_file_path,
    read_hs_file,
    torch_dtype,
    write_hs_file,
)

STAGES = ("teacher", "warmup", "stable")
PAPER_EPOCHS = {"teacher": 8, "warmup": 2, "stable": 6}


# =========================================================================== configuration
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
    anchors_per_seq: Optional[int] = 128  # 0/None = every response position
    max_tokens_per_batch: int = 16384  # per rank and micro-batch, padded tokens
    max_seqs_per_batch: int = 16
    feature_source: str = "online"  # online | files
    features_dir: Optional[str] = None  # files mode; None -> {work_dir}/data/features
    features_dtype: str = "bfloat16"  # dtype of written feature files


@dataclass
class ModelSection:
    num_feature_layers: Optional[int] = None  # None: all layers if N <= 16, else round(14/36 N)
    target_layer_ids: Optional[list[int]] = None  # explicit vLLM aux ids (overrides the above)
    block_size: int = 7  # K = num_speculative_tokens
    num_layers: Optional[int] = None  # draft depth; None: ~14% of the target's layers
    head_rank: Optional[int] = None  # None: hidden_size // 8
    hidden_size: Optional[int] = None  # None: the target's width
    feature_mode: str = "sequence"  # sequence (paper) | feature (ablation)
    mask_token_id: Optional[int] = None  # None: tokenizer's mask token / <|mask|> / padded id
    history_window: Optional[int] = 1024  # teacher's history (None = unlimited)
    init_drafter_from_teacher: bool = True
    init_from: Optional[str] = None  # start DLite from an existing checkpoint directory
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
    gamma: float = losses.DEFAULT_GAMMA
    stable_ce_weight: float = losses.STABLE_CE_WEIGHT
    stable_tv_weight: float = losses.STABLE_TV_WEIGHT


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
    stop_after_steps: Optional[int] = None  # checkpoint and stop at this global step (tests)


@dataclass
class AblationSection:
    stable_only: bool = False  # skip teacher + warm-up (paper's single-stage baseline)


@dataclass
class EvalSection:
    """Offline acceptance estimate after training (rank 0; empty kinds = skipped)."""

    kinds: dict[str, int] = field(default_factory=dict)  # held-out sessions per kind
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
        ``epochs`` is merged over the paper's defaults (stages not named keep 8 / 2 / 6)."""
        data = dict(data or {})
        if isinstance(data.get("epochs"), dict):
            data["epochs"] = {**PAPER_EPOCHS, **data["epochs"]}
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
        if "warmup" in stages and "teacher" not in stages:
            raise ValueError(
                "epochs.warmup > 0 needs a trained teacher (epochs.teacher > 0); set "
                "epochs.warmup: 0 or use --ablation stable_only"
            )
        if self.data.feature_source not in ("online", "files"):
            raise ValueError("data.feature_source must be 'online' or 'files'")
        if self.run.parallel not in ("ddp", "fsdp"):
            raise ValueError("run.parallel must be 'ddp' or 'fsdp'")
        if self.run.precision not in ("auto", "bf16", "fp32"):
            raise ValueError("run.precision must be auto, bf16 or fp32")
        if self.optim.grad_accum_steps < 1:
            raise ValueError("optim.grad_accum_steps must be >= 1")
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


# =========================================================================== distributed
@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_pref: str) -> DistInfo:
    """Init torch.distributed from torchrun's environment (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank, world, local_rank, device)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def wait_for_file(path: Path, newer_than: float = 0.0, poll_s: float = 2.0) -> None:
    """Non-main ranks wait (without a collective, which could time out during a long data
    regeneration) for rank 0 to (re)write ``path``. Rank 0 deletes a stale copy before rewriting
    it, so the file may vanish between two looks; that is waiting, not an error."""
    while True:
        try:
            if path.stat().st_mtime >= newer_than:
                return
        except FileNotFoundError:
            pass
        time.sleep(poll_s)


# =========================================================================== helpers
class StopTraining(Exception):
    """Raised after ``run.stop_after_steps`` (a checkpoint has been written)."""


def default_num_feature_layers(num_target_layers: int) -> int:
    """Paper: 14 of Qwen3-8B's 36 layers; a small target (<= 16 layers) uses all of them."""
    n = num_target_layers
    return n if n <= 16 else max(2, round(14 * n / 36))


def resolve_mask_token_id(target_path: str, target_cfg: dict[str, Any]) -> int:
    """The tokenizer's mask token, else ``<|mask|>``, else the first padded (unused) id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_path)
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    vocab = tok.get_vocab()
    if "<|mask|>" in vocab:
        return int(vocab["<|mask|>"])
    if target_cfg["vocab_size"] > len(tok):
        return len(tok)  # rows past the tokenizer are never produced: a safe placeholder
    raise ValueError(
        f"{target_path}: no mask token found (no tokenizer mask_token, no <|mask|>, no padded "
        "vocabulary rows); set model.mask_token_id to a reserved token id"
    )


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, int(round(warmup_ratio * total_steps))) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        progress = min(max(progress, 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only (no norms, no depth/history embeddings)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.dim() >= 2 and "embedding" not in name
        (decay if is_matrix else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_state_options(all_ranks: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload: rank 0 only gets the tensors (on CPU); other ranks get an empty dict
    return StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)


def full_model_state(model: nn.Module, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded state dict of a plain, DDP or FSDP2 module (FQNs without wrappers).

    Collective under FSDP (every rank must call it). Default: CPU tensors on rank 0 only (for
    saving); ``all_ranks=True``: every rank gets the tensors on the model's device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_state_options(all_ranks))


# =========================================================================== trainer
class Trainer:
    """Runs the whole pipeline for one :class:`TrainConfig` (see the module docstring)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg.validate()
        self.work = cfg.work_dir()
        self.out = Path(cfg.run.out)
        self.info = DistInfo()
        self.t_start = time.time()
        self.global_step = 0
        self.metrics_file = None
        self.tb = None
        self.report: dict[str, Any] = {"stages": {}}

    # ------------------------------------------------------------------ entry point
    def run(self) -> Path:
        cfg = self.cfg
        self.info = init_distributed(cfg.run.device)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.work.mkdir(parents=True, exist_ok=True)
        try:
            self._prepare_data()
            self._build_models()
            self._prepare_features()
            self._open_logs()
            state = self._load_checkpoint()
            stages = cfg.stages()
            if state and state["stage"] not in stages:
                raise ValueError(
                    f"the checkpoint is in stage {state['stage']!r}, which this config does not "
                    f"run (stages: {stages}); use the original config or --resume none"
                )
            start = stages.index(state["stage"]) if state else 0
            for stage in stages[start:]:
                resume = state if state and state["stage"] == stage else None
                if stage == "warmup" and resume is None and cfg.model.init_drafter_from_teacher:
                    self._init_drafter_from_teacher()
                self._train_stage(stage, resume)
                state = None
            self._finish()
        except StopTraining:
            self._log_console(f"stopped at step {self.global_step} (run.stop_after_steps)")
        finally:
            self._close_logs()
            if self.info.enabled and dist.is_initialized():
                dist.destroy_process_group()
        return self.out

    # ------------------------------------------------------------------ data
    def _sequences_path(self) -> Path:
        d = self.cfg.data
        return Path(d.sequences) if d.sequences else self.work / "data" / "sequences.jsonl"

    def regeneration_config(self) -> RegenerationConfig:
        return dataclasses.replace(self.cfg.data.regenerate, max_len=self.cfg.data.max_len)

    def _prepare_data(self) -> None:
        """Regenerate (rank 0, vLLM subprocess) unless given; build the memory-map cache."""
        cfg, info = self.cfg, self.info
        path = self._sequences_path()
        ready = Path(str(path) + ".ready")
        if info.is_main:
            ready.unlink(missing_ok=True)
            if cfg.data.sequences is None and not regeneration_done(
                path, cfg.target.path, self.regeneration_config()
            ):
                self._log_console(f"regenerating training data with the target -> {path}")
                path.parent.mkdir(parents=True, exist_ok=True)
                regenerate_in_subprocess(cfg.target.path, path, self.regeneration_config())
            SequenceStore.open(path, cfg.data.max_len)  # builds the cache once
            ready.write_text("ok\n")
        else:
            wait_for_file(ready, newer_than=self.t_start - 1)
        barrier(info)
        store = SequenceStore.open(path, cfg.data.max_len, build=False)
        keep = [i for i in range(len(store)) if store.num_anchors(i) > 0]
        if not keep:
            raise ValueError(f"{path}: no sequence has a response of >= 2 tokens to train on")
        self.store = store
        self.train_indices = np.asarray(keep, dtype=np.int64)
        self.report["data"] = dict(
            sequences=str(path), num_sequences=len(keep), tokens=int(store.lengths[keep].sum()),
            anchors_available=int(sum(store.num_anchors(i) for i in keep)),
        )

    # ------------------------------------------------------------------ models
    def _build_models(self) -> None:
        cfg, info = self.cfg, self.info
        self.target_hf_config = json.loads((Path(cfg.target.path) / "config.json").read_text())
        t = self.target_hf_config
        n_layers = t["num_hidden_layers"]
        m = cfg.model
        mask_id = (
            m.mask_token_id
            if m.mask_token_id is not None
            else resolve_mask_token_id(cfg.target.path, t)
        )
        overrides: dict[str, Any] = dict(block_size=m.block_size, feature_mode=m.feature_mode)
        overrides.update(m.dlite_overrides)
        for name in ("num_layers", "head_rank", "hidden_size", "target_layer_ids"):
            if getattr(m, name) is not None:
                overrides[name] = getattr(m, name)
        if m.init_from:
            from vllm_dlite.model import read_checkpoint_config

            _, dlite_cfg = read_checkpoint_config(m.init_from)
        else:
            dlite_cfg = DLiteConfig.for_target(
                t,
                num_feature_layers=m.num_feature_layers or default_num_feature_layers(n_layers),
                mask_token_id=mask_id,
                target_name=str(t.get("_name_or_path") or Path(cfg.target.path).name),
                **overrides,
            )
        self.dlite_config = dlite_cfg
        self.layer_ids = list(dlite_cfg.target_layer_ids)
        self.num_target_layers = n_layers

        device = info.device
        precision = cfg.run.precision
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "fp32"
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        target_dtype = torch_dtype(cfg.target.dtype)
        if target_dtype is None:
            target_dtype = torch.float32 if device.type == "cpu" else None  # None = checkpoint

        torch.manual_seed(cfg.run.seed)  # identical init on every rank
        if cfg.data.feature_source == "online":
            self.extractor = TargetFeatureExtractor.from_pretrained(
                cfg.target.path, self.layer_ids, dtype=target_dtype or "auto", device=device,
                attn_implementation=cfg.target.attn_implementation,
            )
            self.target_head = None
            embed, lm_head = self.extractor.embed_weight, self.extractor.lm_head_weight
        else:
            self.extractor = None
            self.target_head = TargetHead.from_pretrained(cfg.target.path, target_dtype, device)
            embed, lm_head = self.target_head.embed_weight, self.target_head.lm_head_weight

        if m.init_from:
            from vllm_dlite.model import load_drafter

            self.drafter = load_drafter(m.init_from, device=device, dtype=torch.float32).train()
        else:
            self.drafter = DLiteDrafter.from_config(dlite_cfg).to(device)
        self.drafter.bind_target(
            None if self.drafter.embed_tokens is not None else embed,
            None if self.drafter.lm_head is not None else lm_head,
        )
        self.teacher = None
        if "teacher" in cfg.stages() or "warmup" in cfg.stages():
            self.teacher = HistoryTeacher.from_drafter(
                self.drafter, history_window=m.history_window
            )
        self.report["model"] = dict(
            dlite_config=dlite_cfg.to_dict(),
            drafter_parameters=sum(p.numel() for p in self.drafter.parameters()),
            teacher_parameters=sum(p.numel() for p in self.teacher.parameters())
            if self.teacher is not None else 0,
        )
        if info.is_main:
            self.work.mkdir(parents=True, exist_ok=True)
            (self.work / "resolved_config.json").write_text(
                json.dumps(dict(train=cfg.to_dict(), dlite=dlite_cfg.to_dict()), indent=2) + "\n"
            )

    # ------------------------------------------------------------------ feature files
    def _features_dir(self) -> Path:
        d = self.cfg.data
        return Path(d.features_dir) if d.features_dir else self.work / "data" / "features"

    def _file_layer_ids(self) -> list[int]:
        return sorted(set(self.layer_ids) | {self.num_target_layers})

    def _prepare_features(self) -> None:
        """Files mode: every rank writes its share of missing ``hs_i`` files (i = store index)."""
        if self.cfg.data.feature_source != "files":
            return
        cfg, info = self.cfg, self.info
        hs_dir = self._features_dir() / HS_DIRNAME
        source = dict(sequences=self.store.fingerprint(), layer_ids=self._file_layer_ids(),
                      dtype=cfg.data.features_dtype, target=str(Path(cfg.target.path).resolve()),
                      target_dtype=cfg.target.dtype)
        source_file = self._features_dir() / "source.json"
        if info.is_main:
            known = json.loads(source_file.read_text()) if source_file.is_file() else None
            if known != source:  # other sequences, layers or target: files are keyed by index
                stale = list(hs_dir.glob("hs_*.safetensors")) if hs_dir.is_dir() else []
                if stale:
                    self._log_console(f"removing {len(stale)} feature files built for other "
                                      f"data/target ({source_file})")
                for path in stale:
                    path.unlink()
                hs_dir.mkdir(parents=True, exist_ok=True)
                source_file.write_text(json.dumps(source, indent=2) + "\n")
        barrier(info)
        todo = [int(i) for i in self.train_indices[info.rank :: info.world_size]
                if not hs_file_path(hs_dir, int(i)).exists()]
        if todo:
            target_dtype = torch_dtype(cfg.target.dtype) or (
                torch.float32 if info.device.type == "cpu" else "auto")
            extractor = TargetFeatureExtractor.from_pretrained(
                cfg.target.path, self._file_layer_ids(), dtype=target_dtype, device=info.device,
                attn_implementation=cfg.target.attn_implementation,
            )
            store_dtype = torch_dtype(cfg.data.features_dtype)
            iterator: Any = todo
            if info.is_main and cfg.run.progress:
                from tqdm.auto import tqdm

                iterator = tqdm(todo, desc="target features", unit="seq", dynamic_ncols=True)
            for i in iterator:
                ids = torch.from_numpy(self.store.token_ids(i).astype(np.int64))
                feats = extractor(ids).features[0]
                write_hs_file(hs_file_path(hs_dir, i), ids,
                              feats.to(store_dtype) if store_dtype else feats,
                              extractor.layer_ids)
            del extractor
        barrier(info)

    def _batch_features(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(features [S, T, L, Ht], last_hidden [S, T, Ht] (pre-norm id N), final_hidden or
        None)`` for a batch, online or from files."""
        if self.extractor is not None:
            out = self.extractor(batch.input_ids, batch.attention_mask)
            return out.features, out.last_hidden, out.final_hidden
        hs_dir = self._features_dir() / HS_DIRNAME
        S, T = batch.input_ids.shape
        feats = None
        last = None
        for row, s in enumerate(batch.seq_numbers):
            f = read_hs_file(hs_file_path(hs_dir, s), layer_ids=self.layer_ids + [
                self.num_target_layers])
            n = int(batch.lengths[row])
            if f.token_ids.shape[0] != n or not torch.equal(
                f.token_ids, batch.input_ids[row, :n].cpu()
            ):
                raise ValueError(
                    f"{hs_file_path(hs_dir, s)} holds other tokens than sequence {s}: the feature "
                    "files are stale; delete the features directory to rebuild them"
                )
            if feats is None:
                L, H = len(self.layer_ids), f.features.shape[-1]
                feats = torch.zeros(S, T, L, H, dtype=f.features.dtype)
                last = torch.zeros(S, T, H, dtype=f.features.dtype)
            feats[row, :n] = f.features[:, :-1]
            last[row, :n] = f.features[:, -1]
        device = self.info.device
        return feats.to(device), last.to(device), None

    # ------------------------------------------------------------------ losses
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=self.autocast_dtype)

    def _target_probs(self, batch, idx, last_hidden, final_hidden) -> torch.Tensor:
        """``p^T [n, K, V]`` fp32 for anchors ``idx``: the target's distribution at positions
        ``t + i`` (i = 0..K-1), i.e. the one that predicted label ``x_{t+i+1}``."""
        pos = batch.block_positions()[idx]  # [n, K]
        rows = batch.seq_index[idx][:, None]
        if final_hidden is not None:
            logits = self.extractor.logits(final_hidden[rows, pos])
        else:
            logits = self.target_head.logits(last_hidden[rows, pos])
        return torch.softmax(logits.float(), dim=-1)

    def _micro_batch_loss(
        self, stage: str, model: nn.Module, batch: SequenceBatch, sync_last: bool
    ) -> dict[str, Any]:
        """Forward + backward of one micro-batch (in anchor chunks); returns detached metrics.

        Chunks combine exactly: each chunk's mean is scaled by its share of the denominator
        (valid tokens for CE, anchors for KL/TV), so the summed gradient equals the full batch's.
        """
        cfg = self.cfg
        features, last_hidden, final_hidden = self._batch_features(batch)
        N, K = batch.labels.shape
        mask = batch.label_mask
        chunks = self._anchor_chunks(N, mask.device)
        weights = losses.position_weights(K, cfg.loss.gamma, device=mask.device)
        total_tokens = mask.sum().clamp_min(1).float()
        total_anchors = (mask.sum(1) > 0).sum().clamp_min(1).float()
        scale = 1.0 / cfg.optim.grad_accum_steps
        metrics: dict[str, Any] = {"hits": torch.zeros(K), "counts": torch.zeros(K)}
        comps: dict[str, float] = {}
        loss_total = 0.0
        for ci, idx in enumerate(chunks):
            # DDP/FSDP reduce gradients once per optimizer step: only the last chunk of the last
            # micro-batch syncs (no_sync must cover the forward too: DDP decides there)
            last = ci == len(chunks) - 1
            sync = contextlib.nullcontext() if (last and sync_last) else self._no_sync(model)
            padding = idx.numel() == 0  # this rank has fewer chunks: a zero-weight stand-in
            if padding:
                idx = torch.zeros(1, dtype=torch.long, device=mask.device)
            with sync:
                loss, parts, logits = self._chunk_loss(stage, model, batch, idx, features,
                                                       last_hidden, final_hidden, weights,
                                                       total_tokens, total_anchors)
                (loss * (0.0 if padding else scale)).backward()
            if padding:
                continue
            loss_total += float(loss.detach())
            for name, (value, share, _) in parts.items():
                comps[name] = comps.get(name, 0.0) + float(value.detach()) * float(share)
            hits, counts = losses.position_accuracy(logits.detach(), batch.labels[idx],
                                                    mask[idx])
            metrics["hits"] += hits.cpu()
            metrics["counts"] += counts.cpu()
        metrics.update(loss=loss_total, anchors=N, tokens=batch.num_tokens, **comps)
        return metrics

    def _anchor_chunks(self, num_anchors: int, device: torch.device) -> list[torch.Tensor]:
        """Split ``0..N-1`` into chunks of <= ``optim.anchor_chunk_size``; under
        torch.distributed every rank uses the same (max) chunk count, so the per-chunk
        collectives (FSDP all-gathers) match; surplus chunks are empty (run as zero-weight
        stand-ins)."""
        size = self.cfg.optim.anchor_chunk_size or num_anchors
        count = max(1, math.ceil(num_anchors / size))
        if self.info.enabled:
            t = torch.tensor([count], device=self.info.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            count = int(t.item())
        return list(torch.tensor_split(torch.arange(num_anchors, device=device), count))

    def _chunk_loss(self, stage, model, batch, idx, features, last_hidden, final_hidden,
                    weights, total_tokens, total_anchors):
        """Loss of anchors ``idx`` scaled by their share of the micro-batch's denominators;
        returns ``(loss, {name: (value, share, coefficient)}, student logits)``."""
        cfg = self.cfg
        m = batch.label_mask[idx]
        share_tok = m.sum().float() / total_tokens
        share_anc = (m.sum(1) > 0).sum().float() / total_anchors
        with self._autocast():
            if stage == "teacher":
                logits = self._teacher_logits(model, features, batch, idx)
            else:
                anchor_feats = features[batch.seq_index[idx], batch.anchor_pos[idx] - 1]
                logits = model(anchor_feats, batch.anchor_ids[idx], batch.labels[idx])
        if stage == "teacher":
            parts = {"ce": (losses.ce_loss(logits, batch.labels[idx], m), share_tok, 1.0)}
        elif stage == "warmup":
            with torch.no_grad(), self._autocast():
                t_logits = self._teacher_logits(self.teacher, features, batch, idx)
            parts = {"kl": (losses.forward_kl(t_logits, logits, weights, m), share_anc, 1.0)}
        else:
            p_t = self._target_probs(batch, idx, last_hidden, final_hidden)
            parts = {
                "ce": (losses.ce_loss(logits, batch.labels[idx], m), share_tok,
                       cfg.loss.stable_ce_weight),
                "tv": (losses.tv_l1(p_t, logits, weights, m), share_anc,
                       cfg.loss.stable_tv_weight),
            }
        loss = sum(value * share * coef for value, share, coef in parts.values())
        return loss, parts, logits

    @staticmethod
    def _teacher_logits(teacher: nn.Module, features: torch.Tensor, batch: SequenceBatch,
                        idx: torch.Tensor) -> torch.Tensor:
        """Teacher forward for anchors ``idx``, given only the sequences they come from (its
        packed attention costs ~ anchors-per-sequence squared, and history is projected per
        sequence: chunking anchors bounds both)."""
        used, local = torch.unique(batch.seq_index[idx], return_inverse=True)
        return teacher(features[used], batch.input_ids[used], local, batch.anchor_pos[idx],
                       batch.labels[idx])

    @staticmethod
    def _no_sync(model: nn.Module):
        if hasattr(model, "no_sync"):  # DDP
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            @contextlib.contextmanager
            def fsdp_no_sync():
                model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    model.set_requires_gradient_sync(True)

            return fsdp_no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ stage loop
    def _plan(self, stage: str, epoch: int) -> list[list[int]]:
        d, info = self.cfg.data, self.info
        lengths = self.store.lengths[self.train_indices]
        local = plan_batches(
            lengths, max_tokens_per_batch=d.max_tokens_per_batch,
            max_seqs_per_batch=d.max_seqs_per_batch, seed=self.cfg.run.seed,
            key=(stage, epoch), rank=info.rank, world_size=info.world_size,
        )
        return [[int(self.train_indices[i]) for i in batch] for batch in local]

    def _steps_in_epoch(self, stage: str, epoch: int) -> int:
        return len(self._plan(stage, epoch)) // self.cfg.optim.grad_accum_steps

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Wrap once per module (DDP/FSDP must not wrap the same module twice)."""
        if not self.info.enabled:
            return model
        cache = self.__dict__.setdefault("_wrapped", {})
        if id(model) not in cache:
            cache[id(model)] = self._make_wrapper(model)
        return cache[id(model)]

    def _make_wrapper(self, model: nn.Module) -> nn.Module:
        if self.cfg.run.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # One FSDP unit: the teacher calls its layers' sub-modules directly (per-layer units
            # would not be gathered); parameters, gradients and optimizer states are sharded.
            return fully_shard(model)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.info.local_rank] if self.info.device.type == "cuda" else None
        return DDP(model, device_ids=ids)

    def _train_stage(self, stage: str, resume: Optional[dict[str, Any]]) -> None:
        cfg, info = self.cfg, self.info
        model = self.teacher if stage == "teacher" else self.drafter
        if stage == "warmup":
            self.teacher.eval().requires_grad_(False)
        model.train().requires_grad_(True)
        wrapped = self._wrap(model)
        opt = torch.optim.AdamW(
            param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas),
        )
        epochs = int(cfg.epochs[stage])
        steps_per_epoch = [self._steps_in_epoch(stage, e) for e in range(epochs)]
        total = sum(steps_per_epoch)
        if cfg.run.max_steps_per_stage is not None:
            total = min(total, cfg.run.max_steps_per_stage)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(total, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
        )
        epoch0, step0, stage_step = 0, 0, 0
        if resume is not None:
            self._restore_optim(wrapped, opt, sched, resume)
            epoch0, step0, stage_step = resume["epoch"], resume["step_in_epoch"], resume[
                "stage_step"]
        self._log_console(
            f"stage {stage}: {epochs} epochs, {total} optimizer steps "
            f"({'resuming at step ' + str(stage_step) if resume else 'from scratch'})"
        )
        bar = None
        if info.is_main and cfg.run.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=stage_step, desc=stage, unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        window = _Window(self.dlite_config.block_size)
        if resume is not None and getattr(self, "_resume_window", None):
            window.__dict__.update(self._resume_window)  # a log window cut by the checkpoint
        accum = cfg.optim.grad_accum_steps
        t_stage = time.time()
        done = stage_step >= total
        for epoch in range(epoch0, epochs):
            if done:
                break
            plan = self._plan(stage, epoch)
            for step in range(step0 if epoch == epoch0 else 0, steps_per_epoch[epoch]):
                t0 = time.time()
                for micro in range(accum):
                    seqs = plan[step * accum + micro]
                    batch = collate(
                        self.store, seqs, block_size=self.dlite_config.block_size,
                        anchors_per_seq=cfg.data.anchors_per_seq,
                        key=(cfg.run.seed, stage, epoch),
                    ).to(info.device)
                    window.add(self._micro_batch_loss(stage, wrapped, batch, micro == accum - 1))
                    window.micro += 1
                grad_norm = nn.utils.clip_grad_norm_(
                    model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e30
                )
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                window.steps += 1
                window.seconds += time.time() - t0
                if hasattr(grad_norm, "full_tensor"):  # FSDP2 DTensor
                    grad_norm = grad_norm.full_tensor()
                window.grad_norm += float(grad_norm)
                stage_step += 1
                self.global_step += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{window.last_loss:.4f}", epoch=epoch)
                if stage_step % cfg.run.log_every == 0 or stage_step == total:
                    self._log_metrics(stage, epoch, stage_step, total, sched, window)
                    window = _Window(self.dlite_config.block_size)
                position = dict(epoch=epoch, step_in_epoch=step + 1)
                if step + 1 == steps_per_epoch[epoch]:
                    position = dict(epoch=epoch + 1, step_in_epoch=0)
                every = cfg.run.checkpoint_every
                stop = cfg.run.stop_after_steps is not None and \
                    self.global_step >= cfg.run.stop_after_steps
                if stage_step >= total:
                    done = True
                    break
                if (every and self.global_step % every == 0) or stop:
                    self._save_checkpoint(stage, stage_step, position, wrapped, opt, sched,
                                          window)
                if stop:
                    raise StopTraining
        if bar is not None:
            bar.close()
        self._save_checkpoint(stage, stage_step, dict(epoch=epochs, step_in_epoch=0), wrapped,
                              opt, sched)
        self.report["stages"][stage] = dict(
            epochs=epochs, steps=total, wall_s=round(time.time() - t_stage, 1)
        )
        if stage == "teacher":
            from safetensors.torch import save_file

            teacher_state = full_model_state(wrapped)  # collective under FSDP
            if info.is_main:
                save_file({k: v.contiguous() for k, v in teacher_state.items()},
                          str(self.work / "teacher.safetensors"))
        if cfg.run.stop_after_steps is not None and self.global_step >= cfg.run.stop_after_steps:
            raise StopTraining
        del wrapped

    def _init_drafter_from_teacher(self) -> None:
        """DLite starts from the trained teacher's shared weights (all but ``history_*``)."""
        from vllm_dlite.model.teacher import HISTORY_PARAM_PREFIXES

        teacher = self.__dict__.get("_wrapped", {}).get(id(self.teacher), self.teacher)
        state = full_model_state(teacher, all_ranks=True)  # collective under FSDP
        self.drafter.load_state_dict(
            {k: v for k, v in state.items() if not k.startswith(HISTORY_PARAM_PREFIXES)}
        )

    # ------------------------------------------------------------------ logging
    def _open_logs(self) -> None:
        if not self.info.is_main:
            return
        self.metrics_file = open(self.work / "metrics.jsonl", "a", encoding="utf-8")
        if self.cfg.run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.work / "tensorboard"))
            except ImportError:
                self.tb = None

    def _close_logs(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def _log_console(self, message: str) -> None:
        if self.info.is_main:
            print(f"[dlite-train] {message}", file=sys.stderr, flush=True)

    def _log_metrics(self, stage, epoch, stage_step, total, sched, window: "_Window") -> None:
        sums = window.reduce(self.info)
        if not self.info.is_main:
            return
        steps = max(1, window.steps)
        micro = max(1, window.micro) * self.info.world_size  # micro-batches over all ranks
        record: dict[str, Any] = dict(
            step=self.global_step, stage=stage, epoch=epoch, stage_step=stage_step,
            stage_steps=total, lr=sched.get_last_lr()[0], loss=sums["loss"] / micro,
        )
        for name in ("ce", "kl", "tv"):
            if name in sums:
                record[name] = sums[name] / micro
        acc = (sums["hits"] / sums["counts"].clamp_min(1)).tolist()
        record["acc"] = [round(a, 4) for a in acc]
        record["tau_proxy"] = round(losses.expected_tau(sums["hits"], sums["counts"]), 4)
        record["grad_norm"] = window.grad_norm / steps
        record["anchors_per_s"] = sums["anchors"] / max(window.seconds, 1e-9)
        record["tokens_per_s"] = sums["tokens"] / max(window.seconds, 1e-9)
        record["elapsed_s"] = round(time.time() - self.t_start, 1)
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.tb is not None:
            for key in ("loss", "ce", "kl", "tv", "lr", "tau_proxy", "grad_norm",
                        "anchors_per_s"):
                if key in record:
                    self.tb.add_scalar(f"{stage}/{key}", record[key], self.global_step)
        self.last_record = record

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> Path:
        return self.work / "checkpoints"

    def _save_checkpoint(self, stage, stage_step, position, wrapped, opt, sched,
                         window: Optional["_Window"] = None) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        info = self.info
        name = f"step-{self.global_step:08d}"
        root = self._ckpt_root()
        final, tmp = root / name, root / f".{name}.tmp"
        model_state = full_model_state(wrapped)  # collective under FSDP: every rank calls it
        optim_state = get_optimizer_state_dict(wrapped, opt, options=_full_state_options())
        trainable = "teacher" if stage == "teacher" else "drafter"
        other_name = "drafter" if trainable == "teacher" else "teacher"
        other = self.drafter if trainable == "teacher" else self.teacher
        wrappers = self.__dict__.get("_wrapped", {})
        other_state = (
            full_model_state(wrappers.get(id(other), other)) if other is not None else None
        )
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(info)
        torch.save(dict(rng=rng_state(), window=dict(window.__dict__) if window else None),
                   tmp / f"rng-rank{info.rank}.pt")
        if info.is_main:
            models = {trainable: model_state}
            if other_state is not None:
                models[other_name] = other_state
            state = dict(
                stage=stage, stage_step=stage_step, global_step=self.global_step,
                world_size=info.world_size, **position, models=models,
                optimizer=optim_state, scheduler=sched.state_dict(),
                config=self.cfg.to_dict(), report_stages=dict(self.report["stages"]),
            )
            torch.save(state, tmp / "trainer.pt")
        barrier(info)
        if info.is_main:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            (root / "latest").write_text(name + "\n")
            keep = max(1, self.cfg.run.keep_checkpoints)
            old = sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]
            for p in old:
                shutil.rmtree(p, ignore_errors=True)
        barrier(info)

    def _load_checkpoint(self) -> Optional[dict[str, Any]]:
        """Restore model weights, RNG and counters; return the state (optimizer restored later)."""
        resume = self.cfg.run.resume
        if resume == "none":
            return None
        if resume == "auto":
            latest = self._ckpt_root() / "latest"
            if not latest.is_file():
                return None
            path = self._ckpt_root() / latest.read_text().strip()
        else:
            path = Path(resume)
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        if state["world_size"] != self.info.world_size:
            self._log_console(
                f"warning: checkpoint written with world size {state['world_size']}, running "
                f"with {self.info.world_size}: data order differs from the original run"
            )
        for name, weights in state["models"].items():
            module = self.teacher if name == "teacher" else self.drafter
            if module is not None:
                module.load_state_dict(weights)
        rng_file = path / f"rng-rank{self.info.rank}.pt"
        if rng_file.is_file():
            per_rank = torch.load(rng_file, weights_only=False)
            set_rng_state(per_rank["rng"])
            self._resume_window = per_rank.get("window")
        self.global_step = state["global_step"]
        self.report["stages"].update(state.get("report_stages", {}))
        self._log_console(f"resuming from {path} (stage {state['stage']}, step "
                          f"{state['global_step']})")
        return state

    def _restore_optim(self, wrapped, opt, sched, state) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(wrapped, opt, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        sched.load_state_dict(state["scheduler"])

    # ------------------------------------------------------------------ export
    def _finish(self) -> None:
        cfg, info = self.cfg, self.info
        wrappers = self.__dict__.get("_wrapped", {})
        drafter_state = full_model_state(wrappers.get(id(self.drafter), self.drafter))
        barrier(info)
        if not info.is_main:
            return
        export_dtype = torch_dtype(cfg.run.export_dtype) if cfg.run.export_dtype != "auto" \
            else torch_dtype(self.target_hf_config.get("torch_dtype")
                             or self.target_hf_config.get("dtype") or "float32")
        drafter = DLiteDrafter(
            self.dlite_config,
            own_embed_tokens=self.drafter.embed_tokens is not None,
            own_lm_head=self.drafter.lm_head is not None,
        )
        drafter.load_state_dict(drafter_state)
        drafter = drafter.to(export_dtype or torch.float32)
        self.out.mkdir(parents=True, exist_ok=True)
        drafter.save_pretrained(self.out, self.target_hf_config)
        self.report.update(
            target=cfg.target.path, out=str(self.out), work_dir=str(self.work),
            world_size=info.world_size, device=str(info.device),
            torch_threads=torch.get_num_threads(), wall_s=round(time.time() - self.t_start, 1),
            final_metrics=getattr(self, "last_record", None), config=cfg.to_dict(),
            command=_command_line(),
        )
        if cfg.eval.kinds or cfg.eval.workloads:
            self.report["offline_eval"] = self._offline_eval()
        (self.out / "training_report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        (self.out / "README.md").write_text(_readme(self.report, self.dlite_config))
        self._log_console(f"drafter written to {self.out}")

    def _offline_eval(self) -> dict[str, Any]:
        from vllm_dlite.eval.offline import evaluate

        e = self.cfg.eval
        return evaluate(
            target=self.cfg.target.path, drafter=str(self.out), workloads=e.workloads,
            kinds=e.kinds, seed=e.seed, max_requests_per_kind=e.max_requests_per_kind,
            max_new_tokens=e.max_new_tokens, max_prompt_tokens=e.max_prompt_tokens,
            check_lossless=False, progress=self.cfg.run.progress, device=str(self.info.device),
            dtype=self.cfg.target.dtype,
        )


class _Window:
    """Metric sums since the last log line (reduced across ranks when logging)."""

    def __init__(self, K: int):
        self.sums: dict[str, Any] = {"hits": torch.zeros(K), "counts": torch.zeros(K),
                                     "loss": 0.0, "anchors": 0.0, "tokens": 0.0}
        self.steps = 0
        self.micro = 0
        self.seconds = 0.0
        self.grad_norm = 0.0
        self.last_loss = float("nan")
        self._step_loss = 0.0

    def add(self, m: dict[str, Any]) -> None:
        for key, value in m.items():
            if key in ("hits", "counts"):
                self.sums[key] += value
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.last_loss = float(m["loss"])

    def reduce(self, info: DistInfo) -> dict[str, Any]:
        keys = sorted(k for k in self.sums if k not in ("hits", "counts"))
        flat = torch.cat([torch.tensor([float(self.sums[k]) for k in keys], dtype=torch.float64),
                          self.sums["hits"].double(), self.sums["counts"].double()])
        if info.enabled:
            flat = flat.to(info.device)
            dist.all_reduce(flat)
            flat = flat.cpu()
        K = self.sums["hits"].shape[0]
        out = {k: float(v) for k, v in zip(keys, flat[: len(keys)].tolist(), strict=True)}
        out["hits"] = flat[len(keys) : len(keys) + K]
        out["counts"] = flat[len(keys) + K :]
        return out


def _readme(report: dict[str, Any], dlite: DLiteConfig) -> str:
    data = report.get("data", {})
    stages = report.get("stages", {})
    lines = [
        f"# DLite drafter for `{report.get('target')}`",
        "",
        "History-free DLite drafter (arXiv 2610.23787) trained by `vllm_dlite.train`.",
        "",
        f"- Command: `{report.get('command')}`",
        f"- Target layers (vLLM aux ids): {dlite.target_layer_ids}; K = {dlite.block_size}; "
        f"depth {dlite.num_layers}; width {dlite.hidden_size}; head rank {dlite.head_rank}; "
        f"feature mode {dlite.feature_mode}",
        f"- Data: {data.get('num_sequences')} on-policy sequences "
        f"({data.get('tokens')} tokens, {data.get('anchors_available')} anchors) from "
        f"`{data.get('sequences')}`",
        "- Stages: " + ", ".join(f"{k} {v['epochs']} ep / {v['steps']} steps / {v['wall_s']} s"
                                 for k, v in stages.items()),
        f"- Wall time: {report.get('wall_s')} s on {report.get('world_size')} x "
        f"{report.get('device')} ({report.get('torch_threads')} threads per rank)",
    ]
    ev = report.get("offline_eval")
    if ev:
        s = ev["settings"]
        lines.append(
            f"- Offline greedy estimate (`vllm_dlite.eval.offline`, K={s['k']}, "
            f"max_new_tokens={s['max_new_tokens']}, {s['kinds'] or s['workloads']} "
            f"{s['split']}): tau {ev['overall'].get('tau')} (per kind: "
            + ", ".join(f"{k} {v.get('tau')}" for k, v in ev.get("per_kind", {}).items()) + ")"
        )
    lines += [
        "",
        "Serve with vLLM: `--speculative-config '{\"method\": \"dlite\", "
        f"\"model\": \"<this dir>\", \"num_speculative_tokens\": {dlite.block_size}}}'`.",
        "",
    ]
    return "\n".join(lines)


def _command_line() -> str:
    """The command as a user would type it (``python -m vllm_dlite.train ...``)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("vllm_dlite/train/__main__.py", "vllm_dlite/train/cli.py")):
        argv[0:1] = ["python", "-m", "vllm_dlite.train"]
    world = os.environ.get("WORLD_SIZE")
    if world and world != "1":
        argv[0:1] = ["torchrun", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', world)}"]
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


__all__ = [
    "PAPER_EPOCHS",
    "STAGES",
    "TrainConfig",
    "Trainer",
    "default_num_feature_layers",
    "resolve_mask_token_id",
]
