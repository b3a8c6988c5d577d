"""DLite drafter training to the authors' recipe (``docs/dlite_v1.md`` §6, format ``dlite_v1``).

Stages (each its own AdamW + warm-up/cosine schedule; paper epochs 8 / 2 / 6):

* ``teacher``: the sliding-window teacher :class:`~vllm_dlite.model.teacher.SWATeacher`
  (``swa_teacher``: the student's backbone and head plus ``W-1`` fused history slots) trained with
  CE on the target's greedy tokens, the RNN fed the ground-truth previous tokens.
* ``kl`` (stage 1): the student backbone from scratch; the teacher's sequential head is copied into
  the student and FROZEN; loss ``sum_k w_k KL(p_teacher || q_student)`` over the head logits.
* ``stable`` (stage 2): teacher removed, head unfrozen; ``lambda_CE * CE + lambda_TV * sum_k w_k
  ||q - p||_1`` with ``p`` the target's teacher-forced distribution at positions ``a..a+B-2``.
* Transition (the authors' schedule is unknown; ours): a hard switch at each stage boundary. The
  student's head is the teacher's at the start of ``kl`` and becomes trainable at the start of
  ``stable``, which starts a fresh optimizer whose learning rate re-warms (``optim.warmup_ratio``).

``w_k = exp(-k / gamma)`` (0-based k), every loss normalised by the sum of ``w`` over the active
positions, summed over ranks (:mod:`vllm_dlite.train.losses`). Anchors: up to
``data.anchors_per_seq`` (authors: 512) per sequence, uniform without replacement from the
authors' range (:func:`vllm_dlite.train.sequences.anchor_range`), redrawn every epoch.

Target features (vLLM aux convention, pre-norm; the drafter/teacher apply the target's final norm
to the last layer themselves) come ONLINE from the frozen target in every step (``data.
feature_source: online``) or from feature files written once (``files``: per sequence only the
rows from ``P - W - 1`` on, where ``P`` is the response start, for the union of the drafter's
layers, the teacher's history layers and aux id N, which also gives ``p`` through the target's
final norm + lm_head).

Scale-out: ``torchrun --nproc-per-node G -m vllm_dlite.train ...``; gloo on CPU, nccl on GPU;
``run.parallel: ddp`` (default) or ``fsdp``. bf16 autocast on GPU (``run.precision``).

Exact resume: checkpoints (``run.checkpoint_every`` optimizer steps, and at the end of every stage)
hold both models, the optimizer, the scheduler, every rank's RNG states and the data position
(stage, epoch, step). Data order and anchor sampling are pure functions of ``(seed, stage, epoch,
sequence)``, so a resumed run replays the uninterrupted loss curve. ``run.stage_time_budget_s``
ends a stage early (its LR schedule is then cut short; the report says so).

Outputs: ``run.out`` receives the drafter checkpoint (``config.json`` + ``model.safetensors`` in
the authors' layout, :func:`vllm_dlite.model.save_pretrained`), ``README.md`` and
``training_report.json``; ``run.work_dir`` holds the regenerated data, feature files, the
teacher, checkpoints and ``metrics.jsonl``.

This module is the stage loop; its parts live in :mod:`~vllm_dlite.train.config` (the config),
:mod:`~vllm_dlite.train.objective` (a micro-batch's loss), :mod:`~vllm_dlite.train.feature_files`,
:mod:`~vllm_dlite.train.checkpointing`, :mod:`~vllm_dlite.train.distributed`,
:mod:`~vllm_dlite.train.metrics`, :mod:`~vllm_dlite.train.recipe` and
:mod:`~vllm_dlite.train.model_card`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vllm_dlite.config import DLiteConfig
from vllm_dlite.model import DLiteDrafter, save_pretrained
from vllm_dlite.model.teacher import HEAD_PREFIX, SWATeacher, default_history_layer_ids
from vllm_dlite.train.checkpointing import (
    find_checkpoint,
    optimizer_state,
    read_checkpoint,
    restore_optimizer,
    set_rng_state,
    write_checkpoint,
)
from vllm_dlite.train.config import TrainConfig
from vllm_dlite.train.data import RegenerationConfig, regenerate_in_subprocess, regeneration_done
from vllm_dlite.train.distributed import (
    DistInfo,
    agree,
    barrier,
    full_model_state,
    init_distributed,
    wait_for_file,
    wrap_model,
)
from vllm_dlite.train.feature_files import write_feature_files
from vllm_dlite.train.features import HS_DIRNAME, TargetFeatureExtractor, TargetHead, torch_dtype
from vllm_dlite.train.metrics import MetricsLog, MetricWindow
from vllm_dlite.train.model_card import command_line, model_card
from vllm_dlite.train.objective import StageObjective
from vllm_dlite.train.recipe import (
    default_num_feature_layers,
    init_head_from_target,
    lr_lambda,
    param_groups,
    resolve_mask_token_id,
)
from vllm_dlite.train.sequences import SequenceStore, collate, plan_batches


class StopTraining(Exception):
    """Raised after ``run.stop_after_steps`` (a checkpoint has been written)."""


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
        self.metrics_log: Optional[MetricsLog] = None
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
                if stage == "kl" and resume is None:
                    self._copy_teacher_head()
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
        B, G = cfg.model.block_size, cfg.model.anchor_group_size
        keep = [i for i in range(len(store)) if store.num_anchors(i, B, G) > 0]
        if not keep:
            raise ValueError(f"{path}: no sequence has a response of >= {B} tokens (one block) "
                             "to train on")
        self.store = store
        self.train_indices = np.asarray(keep, dtype=np.int64)
        self.report["data"] = dict(
            sequences=str(path), num_sequences=len(keep), tokens=int(store.lengths[keep].sum()),
            anchors_available=int(sum(store.num_anchors(i, B, G) for i in keep)),
            anchors_per_epoch=int(sum(min(store.num_anchors(i, B, G), cfg.data.anchors_per_seq
                                          or 1 << 62) for i in keep)),
        )

    # ------------------------------------------------------------------ models
    def _build_models(self) -> None:
        cfg, info = self.cfg, self.info
        self.target_hf_config = json.loads((Path(cfg.target.path) / "config.json").read_text())
        t = self.target_hf_config
        n_layers = t["num_hidden_layers"]
        m = cfg.model
        if m.init_from:
            from vllm_dlite.model import read_checkpoint_config

            _, dlite_cfg = read_checkpoint_config(m.init_from)
        else:
            mask_id = (m.mask_token_id if m.mask_token_id is not None
                       else resolve_mask_token_id(cfg.target.path, t))
            overrides: dict[str, Any] = {  # DLiteConfig fields of the same names
                name: getattr(m, name) for name in ("block_size", "anchor_group_size", "num_hidden_layers",
                                                    "sequential_rank") if getattr(m, name) is not None}
            overrides.update(m.dlite_overrides)
            dlite_cfg = DLiteConfig.for_target(
                t, num_feature_layers=m.num_feature_layers or default_num_feature_layers(n_layers),
                mask_token_id=mask_id, **overrides,
            )
        self.dlite_config = dlite_cfg
        self.num_target_layers = n_layers
        self.history_layer_ids = list(m.teacher_history_layer_ids or
                                      default_history_layer_ids(n_layers))
        # aux ids: the drafter's, the teacher's history layers, and N (p^T); one file layout
        self.feature_aux_ids = sorted(set(dlite_cfg.aux_layer_ids)
                                      | {j + 1 for j in self.history_layer_ids} | {n_layers})

        device = info.device
        precision = cfg.run.precision
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "fp32"
        autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        target_dtype = torch_dtype(cfg.target.dtype)
        if target_dtype is None:
            target_dtype = torch.float32 if device.type == "cpu" else None  # None = checkpoint

        if cfg.data.feature_source == "online":
            self.extractor = TargetFeatureExtractor.from_pretrained(
                cfg.target.path, self.feature_aux_ids, dtype=target_dtype or "auto", device=device,
                attn_implementation=cfg.target.attn_implementation,
            )
            self.target_head = self.extractor.head()
            embed = self.extractor.embed_weight
        else:
            self.extractor = None
            self.target_head = TargetHead.from_pretrained(cfg.target.path, target_dtype, device)
            embed = self.target_head.embed_weight
        norm_w, eps = self.target_head.norm_weight, self.target_head.eps

        torch.manual_seed(cfg.run.seed)  # identical init on every rank
        if m.init_from:
            from vllm_dlite.model import load_drafter

            self.drafter = load_drafter(m.init_from, device=device, dtype=torch.float32).train()
        else:
            self.drafter = DLiteDrafter(dlite_cfg).to(device)
            if m.head_init == "target_svd":
                init_head_from_target(self.drafter, self.target_head.lm_head_weight)
        self.drafter.bind_target(embed.float(), norm_w.float(), eps)
        self.teacher = None
        if "teacher" in cfg.stages() or "kl" in cfg.stages():
            torch.manual_seed(cfg.run.seed + 1)
            self.teacher = SWATeacher(dlite_cfg, window=m.teacher_window,
                                      history_layer_ids=self.history_layer_ids).to(device)
            if m.head_init == "target_svd":
                init_head_from_target(self.teacher, self.target_head.lm_head_weight)
            self.teacher.bind_target(embed.float(), norm_w.float(), eps)
        ids = self.feature_aux_ids
        self.objective = StageObjective(
            cfg, info, target_head=self.target_head, teacher=self.teacher, layer_ids=ids,
            cur_idx=[ids.index(i) for i in dlite_cfg.aux_layer_ids],
            hist_idx=[ids.index(j + 1) for j in self.history_layer_ids],
            last_idx=ids.index(n_layers), autocast_dtype=autocast_dtype,
            extractor=self.extractor, hs_dir=self._features_dir() / HS_DIRNAME,
        )
        self.report["model"] = dict(
            format="dlite_v1",
            dlite_config=dlite_cfg.to_dict(),
            aux_layer_ids=dlite_cfg.aux_layer_ids,
            teacher=dict(window=m.teacher_window, history_layer_ids=self.history_layer_ids)
            if self.teacher is not None else None,
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
        return Path(d.features_dir) if d.features_dir else self.work / "data" / "features_v1"

    def _prepare_features(self) -> None:
        """Files mode: every rank writes its share of the missing feature files."""
        if self.cfg.data.feature_source != "files":
            return
        wall_s = write_feature_files(self.cfg, self._features_dir(), self.store,
                                     self.train_indices, self.feature_aux_ids, self.info,
                                     log=self._log_console)
        if self.info.is_main:
            self.report.setdefault("features", dict(
                dir=str(self._features_dir()), aux_layer_ids=self.feature_aux_ids,
                dtype=self.cfg.data.features_dtype))
            if wall_s is not None:
                self.report["features"]["wall_s"] = wall_s

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
        """Wrap once per module and set of trainable parameters (DDP registers the trainable
        parameters when it wraps: the student is wrapped again when its head is unfrozen)."""
        if not self.info.enabled:
            return model
        cache = self.__dict__.setdefault("_wrapped", {})
        key = (id(model), tuple(n for n, p in model.named_parameters() if p.requires_grad))
        if key not in cache:
            cache[key] = wrap_model(model, self.info, self.cfg.run.parallel)
        cache[id(model)] = cache[key]
        return cache[key]

    def _train_stage(self, stage: str, resume: Optional[dict[str, Any]]) -> None:
        cfg, info = self.cfg, self.info
        model = self.teacher if stage == "teacher" else self.drafter
        model.train().requires_grad_(True)
        if stage == "kl":
            self.teacher.eval().requires_grad_(False)
            model.sequential_head.requires_grad_(False)  # the teacher's head, frozen in stage 1
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
            restore_optimizer(wrapped, opt, sched, resume)
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
        window = MetricWindow(self.dlite_config.num_draft_tokens)
        if resume is not None and getattr(self, "_resume_window", None):
            window.__dict__.update(self._resume_window)  # a log window cut by the checkpoint
        accum = cfg.optim.grad_accum_steps
        t_stage = time.time() - (float(resume.get("stage_elapsed_s", 0.0)) if resume else 0.0)
        budget = cfg.run.stage_time_budget_s.get(stage)
        truncated = False
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
                        group_size=self.dlite_config.anchor_group_size,
                    ).to(info.device)
                    window.add(self.objective.micro_batch_loss(stage, wrapped, batch,
                                                              micro == accum - 1))
                    window.micro += 1
                grad_norm = nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad],
                    cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e30,
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
                    window = MetricWindow(self.dlite_config.num_draft_tokens)
                position = dict(epoch=epoch, step_in_epoch=step + 1,
                                stage_elapsed_s=time.time() - t_stage)
                if step + 1 == steps_per_epoch[epoch]:
                    position.update(epoch=epoch + 1, step_in_epoch=0)
                every = cfg.run.checkpoint_every
                stop = cfg.run.stop_after_steps is not None and \
                    self.global_step >= cfg.run.stop_after_steps
                if stage_step >= total:
                    done = True
                    break
                if budget is not None and agree(self.info, time.time() - t_stage >= budget):
                    self._log_console(f"stage {stage}: time budget {budget:.0f} s reached at "
                                      f"step {stage_step}/{total}; next stage")
                    if stage_step % cfg.run.log_every:
                        self._log_metrics(stage, epoch, stage_step, total, sched, window)
                    truncated = done = True
                    break
                if (every and self.global_step % every == 0) or stop:
                    self._save_checkpoint(stage, stage_step, position, wrapped, opt, sched,
                                          window)
                if stop:
                    raise StopTraining
        if bar is not None:
            bar.close()
        wall = round(time.time() - t_stage, 1)
        self.report["stages"][stage] = dict(
            epochs=epochs, steps=stage_step, planned_steps=total, wall_s=wall,
            **({"stopped_by_time_budget_s": budget} if truncated else {}),
        )
        self._save_checkpoint(stage, stage_step, dict(epoch=epochs, step_in_epoch=0,
                                                      stage_elapsed_s=wall), wrapped, opt, sched)
        if stage == "teacher":
            from safetensors.torch import save_file

            teacher_state = full_model_state(wrapped)  # collective under FSDP
            if info.is_main:
                save_file({k: v.contiguous() for k, v in teacher_state.items()},
                          str(self.work / "teacher.safetensors"))
        if cfg.run.stop_after_steps is not None and self.global_step >= cfg.run.stop_after_steps:
            raise StopTraining
        del wrapped

    def _copy_teacher_head(self) -> None:
        """Stage 1 starts with the teacher's sequential head in the student (frozen there);
        the student's backbone keeps its fresh initialisation (trained from scratch)."""
        teacher = self.__dict__.get("_wrapped", {}).get(id(self.teacher), self.teacher)
        state = full_model_state(teacher, all_ranks=True)  # collective under FSDP
        head = {k: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
        missing, unexpected = self.drafter.load_state_dict(head, strict=False)
        if unexpected or len(head) != len(self.drafter.sequential_head.state_dict()):
            raise RuntimeError(f"teacher head does not fit the student: {unexpected}")

    # ------------------------------------------------------------------ logging
    def _open_logs(self) -> None:
        if not self.info.is_main:
            return
        tb_dir = self.work / "tensorboard" if self.cfg.run.tensorboard else None
        self.metrics_log = MetricsLog(self.work / "metrics.jsonl", tb_dir)

    def _close_logs(self) -> None:
        if self.metrics_log is not None:
            self.metrics_log.close()
            self.metrics_log = None

    def _log_console(self, message: str) -> None:
        if self.info.is_main:
            print(f"[dlite-train] {message}", file=sys.stderr, flush=True)

    def _log_metrics(self, stage, epoch, stage_step, total, sched, window: MetricWindow) -> None:
        summary = window.summary(self.info)  # collective
        if not self.info.is_main:
            return
        record: dict[str, Any] = dict(
            step=self.global_step, stage=stage, epoch=epoch, stage_step=stage_step,
            stage_steps=total, lr=sched.get_last_lr()[0], **summary,
            elapsed_s=round(time.time() - self.t_start, 1),
        )
        self.metrics_log.write(record)
        self.last_record = record

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> Path:
        return self.work / "checkpoints"

    def _save_checkpoint(self, stage, stage_step, position, wrapped, opt, sched,
                         window: Optional[MetricWindow] = None) -> None:
        info = self.info
        model_state = full_model_state(wrapped)  # collective under FSDP: every rank calls it
        optim_state = optimizer_state(wrapped, opt)
        trainable = "teacher" if stage == "teacher" else "drafter"
        other_name = "drafter" if trainable == "teacher" else "teacher"
        other = self.drafter if trainable == "teacher" else self.teacher
        wrappers = self.__dict__.get("_wrapped", {})
        other_state = (
            full_model_state(wrappers.get(id(other), other)) if other is not None else None
        )
        state = None
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
        write_checkpoint(self._ckpt_root(), self.global_step, info, state,
                         window=dict(window.__dict__) if window else None,
                         keep=self.cfg.run.keep_checkpoints)

    def _load_checkpoint(self) -> Optional[dict[str, Any]]:
        """Restore model weights, RNG and counters; return the state (optimizer restored later)."""
        path = find_checkpoint(self._ckpt_root(), self.cfg.run.resume)
        if path is None:
            return None
        state, per_rank = read_checkpoint(path, self.info.rank)
        if state["world_size"] != self.info.world_size:
            self._log_console(
                f"warning: checkpoint written with world size {state['world_size']}, running "
                f"with {self.info.world_size}: data order differs from the original run"
            )
        for name, weights in state["models"].items():
            module = self.teacher if name == "teacher" else self.drafter
            if module is not None:
                module.load_state_dict(weights)
        if per_rank is not None:
            set_rng_state(per_rank["rng"])
            self._resume_window = per_rank.get("window")
        self.global_step = state["global_step"]
        self.report["stages"].update(state.get("report_stages", {}))
        self._log_console(f"resuming from {path} (stage {state['stage']}, step "
                          f"{state['global_step']})")
        return state

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
        drafter = DLiteDrafter(self.dlite_config)
        drafter.load_state_dict(drafter_state)
        self.out.mkdir(parents=True, exist_ok=True)
        save_pretrained(drafter, self.out, self.target_hf_config, export_dtype or torch.float32)
        self.report["export_dtype"] = str(export_dtype or torch.float32).removeprefix("torch.")
        self.report.update(
            target=cfg.target.path, out=str(self.out), work_dir=str(self.work),
            world_size=info.world_size, device=str(info.device),
            torch_threads=torch.get_num_threads(), wall_s=round(time.time() - self.t_start, 1),
            final_metrics=getattr(self, "last_record", None), config=cfg.to_dict(),
            command=command_line(),
        )
        if cfg.eval.kinds or cfg.eval.workloads:
            self.report["offline_eval"] = self._offline_eval()
        (self.out / "training_report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        (self.out / "README.md").write_text(model_card(self.report, self.dlite_config))
        if self.metrics_log is not None:
            self.metrics_log.flush()
            shutil.copyfile(self.work / "metrics.jsonl", self.out / "metrics.jsonl")
        self._log_console(f"drafter written to {self.out}")

    def _offline_eval(self) -> dict[str, Any]:
        from vllm_dlite.train.offline_eval import evaluate

        e = self.cfg.eval
        return evaluate(
            target=self.cfg.target.path, drafter=str(self.out), workloads=e.workloads,
            kinds=e.kinds, split=e.split, seed=e.seed, max_requests_per_kind=e.max_requests_per_kind,
            max_new_tokens=e.max_new_tokens, max_prompt_tokens=e.max_prompt_tokens,
            check_lossless=False, progress=self.cfg.run.progress, device=str(self.info.device),
            dtype=self.cfg.target.dtype,
        )


__all__ = ["Trainer"]
