"""The training objective of one micro-batch (the stage losses of :mod:`vllm_dlite.train.trainer`):
:meth:`StageObjective.micro_batch_loss` fetches the batch's target features (online from the
frozen target's extractor, or from the feature files), runs the forward and backward of the
stage's loss over the anchors in chunks (``optim.anchor_chunk_size``; only the last chunk of the
step's last micro-batch synchronises gradients) and returns detached metric sums. Losses
(:mod:`vllm_dlite.train.losses`): ``teacher`` CE on the target's greedy tokens, ``kl`` the
frozen teacher's KL, ``stable`` ``lambda_CE * CE + lambda_TV * |q - p|_1``, each normalised by the
position weights summed over every rank's active positions. The optimizer step, data order and
model wrapping are the caller's.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from vllm_dlite.model.teacher import gather_history
from vllm_dlite.train import losses
from vllm_dlite.train.config import TrainConfig
from vllm_dlite.train.distributed import DistInfo, no_sync
from vllm_dlite.train.feature_files import read_batch_features
from vllm_dlite.train.features import TargetFeatureExtractor, TargetHead
from vllm_dlite.train.sequences import SequenceBatch


class StageObjective:
    """Loss of a micro-batch for one run. Features hold the target layers ``layer_ids`` (vLLM aux
    ids); ``cur_idx`` / ``hist_idx`` / ``last_idx`` index in them the drafter's layers, the
    teacher's history layers and id N (the target's last hidden state, which gives ``p``).
    ``extractor`` None: features come from the files in ``hs_dir``."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, *, target_head: TargetHead,
                 teacher: Optional[nn.Module], layer_ids: list[int], cur_idx: list[int],
                 hist_idx: list[int], last_idx: int, autocast_dtype: Optional[torch.dtype],
                 extractor: Optional[TargetFeatureExtractor] = None,
                 hs_dir: Optional[Path] = None):
        self.cfg, self.info = cfg, info
        self.target_head, self.teacher = target_head, teacher
        self.layer_ids = layer_ids
        self.cur_idx, self.hist_idx, self.last_idx = cur_idx, hist_idx, last_idx
        self.autocast_dtype = autocast_dtype
        self.extractor, self.hs_dir = extractor, hs_dir

    def batch_features(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [S, T', Lf, H], row_start [S])``: the ``layer_ids`` features of positions
        ``row_start[s] ..`` (online: every position, row_start 0)."""
        if self.extractor is not None:
            out = self.extractor(batch.input_ids, batch.attention_mask)
            S = batch.input_ids.shape[0]
            return out.features, torch.zeros(S, dtype=torch.long, device=out.features.device)
        return read_batch_features(self.hs_dir, batch, self.layer_ids, self.info.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=self.autocast_dtype)

    def _rows_at(self, rows, row_start, seq_index, pos, layer_idx):
        """Feature rows ``[..., len(layer_idx) or H]`` at absolute positions ``pos`` (any shape
        broadcastable with ``seq_index``)."""
        local = pos - row_start[seq_index]
        if bool((local < 0).any()) or bool((local >= rows.shape[1]).any()):
            raise RuntimeError("an anchor reads a feature row that was not stored (feature files "
                               "built for another teacher window?); delete the features dir")
        return rows[seq_index, local][..., layer_idx, :].float()

    def _target_probs(self, batch, idx, rows, row_start) -> torch.Tensor:
        """``p [n, K, V]`` fp32 for anchors ``idx``: the target's distribution at positions
        ``a + k`` (k = 0..K-1), i.e. the one that predicted label ``x_{a+k+1}``."""
        pos = batch.block_positions()[idx]  # [n, K]
        seq = batch.seq_index[idx][:, None].expand_as(pos)
        last = self._rows_at(rows, row_start, seq, pos, self.last_idx)
        return torch.softmax(self.target_head.logits(last).float(), dim=-1)

    def micro_batch_loss(
        self, stage: str, model: nn.Module, batch: SequenceBatch, sync_last: bool
    ) -> dict[str, Any]:
        """Forward + backward of one micro-batch (in anchor chunks); returns detached metrics.

        Every loss is ``sum m w D / Z`` with ``Z`` = the sum of the position weights over the
        active positions of the micro-batch on ALL ranks (all-reduced); each rank's loss is
        multiplied by the world size because DDP averages gradients. Chunks just add numerators.
        """
        cfg = self.cfg
        rows, row_start = self.batch_features(batch)
        N, K = batch.labels.shape
        mask = batch.label_mask
        chunks = self._anchor_chunks(N, mask.device)
        w = self._weights(stage, K, mask.device)
        z = losses.normaliser(mask, w).reshape(1).to(torch.float64)
        if self.info.enabled:
            z = z.to(self.info.device)
            dist.all_reduce(z)
        denom = float(z.item()) / self.info.world_size
        scale = 1.0 / cfg.optim.grad_accum_steps
        metrics: dict[str, Any] = {"hits": torch.zeros(K), "counts": torch.zeros(K)}
        comps: dict[str, float] = {}
        loss_total = 0.0
        for ci, idx in enumerate(chunks):
            # DDP/FSDP reduce gradients once per optimizer step: only the last chunk of the last
            # micro-batch syncs (no_sync must cover the forward too: DDP decides there)
            last = ci == len(chunks) - 1
            sync = contextlib.nullcontext() if (last and sync_last) else no_sync(model)
            padding = idx.numel() == 0  # this rank has fewer chunks: a zero-weight stand-in
            if padding:
                idx = torch.zeros(1, dtype=torch.long, device=mask.device)
            with sync:
                loss, parts, logits = self._chunk_loss(stage, model, batch, idx, rows, row_start,
                                                       w, denom)
                (loss * (0.0 if padding else scale)).backward()
            if padding:
                continue
            loss_total += float(loss.detach())
            for name, value in parts.items():
                comps[name] = comps.get(name, 0.0) + float(value)
            hits, counts = losses.position_accuracy(logits.detach(), batch.labels[idx], mask[idx])
            metrics["hits"] += hits
            metrics["counts"] += counts
        metrics.update(loss=loss_total, anchors=N, tokens=batch.num_tokens, **comps)
        return metrics

    def _weights(self, stage: str, K: int, device) -> torch.Tensor:
        if stage == "teacher" and not self.cfg.loss.teacher_position_weights:
            return torch.ones(K, device=device)
        return losses.position_weights(K, self.cfg.loss.gamma, device=device)

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

    def _chunk_loss(self, stage, model, batch, idx, rows, row_start, w, denom):
        """Loss of anchors ``idx``: numerators over the micro-batch normaliser ``denom``;
        returns ``(loss, {name: value as a share of the micro-batch mean}, student logits)``."""
        cfg = self.cfg
        m = batch.label_mask[idx]
        seq, pos = batch.seq_index[idx], batch.anchor_pos[idx]
        feats = self._rows_at(rows, row_start, seq, pos - 1, self.cur_idx)  # [n, L, H] at a-1
        group, labels = batch.group_ids[idx], batch.labels[idx]
        with self._autocast():
            if stage == "teacher":
                logits = self._teacher_logits(model, rows, row_start, batch, idx, feats)
            else:
                logits = model(feats, group, labels)
        if stage == "teacher":
            parts = {"ce": losses.weighted_sum(losses.ce_per_position(logits, labels), m, w)}
            coefs = {"ce": 1.0}
        elif stage == "kl":
            with torch.no_grad(), self._autocast():
                t_logits = self._teacher_logits(self.teacher, rows, row_start, batch, idx, feats)
            parts = {"kl": losses.weighted_sum(losses.kl_per_position(t_logits, logits), m, w)}
            coefs = {"kl": 1.0}
        else:
            p_t = self._target_probs(batch, idx, rows, row_start)
            parts = {
                "ce": losses.weighted_sum(losses.ce_per_position(logits, labels), m, w),
                "tv": losses.weighted_sum(losses.l1_per_position(p_t, logits), m, w),
            }
            coefs = {"ce": cfg.loss.stable_ce_weight, "tv": cfg.loss.stable_tv_weight}
        loss = sum(parts[k] * coefs[k] for k in parts) / denom
        return loss, {k: v.detach() / denom for k, v in parts.items()}, logits

    def _teacher_logits(self, teacher: nn.Module, rows, row_start, batch: SequenceBatch,
                        idx: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Teacher forward for anchors ``idx`` with their history windows."""
        module = getattr(teacher, "module", teacher)
        seq, pos = batch.seq_index[idx], batch.anchor_pos[idx]
        hist_rows = rows[..., self.hist_idx, :]
        history, valid = gather_history(hist_rows, row_start, seq, pos, module.num_history_slots)
        return teacher(feats, batch.group_ids[idx], batch.labels[idx], False, history.float(), valid)


__all__ = ["StageObjective"]
