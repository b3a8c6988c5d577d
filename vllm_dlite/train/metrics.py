"""Training metrics of :mod:`vllm_dlite.train`: :class:`MetricWindow` sums a rank's micro-batch
metrics between two log lines (and rides along in a checkpoint when one cuts it), reduces them
over the ranks and turns them into means; :class:`MetricsLog` appends the records to
``metrics.jsonl`` (one JSON object per log line: ``step``, ``stage``, ``epoch``, ``lr``, ``loss``
and its parts, per-position ``acc``, ``tau_proxy``, ``grad_norm``, throughput, ``elapsed_s``) and
TensorBoard. When to log and what the step and learning rate are is the trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from vllm_dlite.train import losses
from vllm_dlite.train.distributed import DistInfo


class MetricWindow:
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

    def summary(self, info: DistInfo) -> Optional[dict[str, Any]]:
        """Collective (:meth:`MetricWindow.reduce`): on rank 0 the window's means over all ranks (loss and its
        parts per micro-batch, per-position accuracy, the tau proxy, grad norm per step,
        throughput); None on the other ranks."""
        sums = self.reduce(info)
        if not info.is_main:
            return None
        steps = max(1, self.steps)
        micro = max(1, self.micro) * info.world_size  # micro-batches over all ranks
        record: dict[str, Any] = dict(loss=sums["loss"] / micro)
        for name in ("ce", "kl", "tv"):
            if name in sums:
                record[name] = sums[name] / micro
        acc = (sums["hits"] / sums["counts"].clamp_min(1)).tolist()
        record["acc"] = [round(a, 4) for a in acc]
        record["tau_proxy"] = round(losses.expected_tau(sums["hits"], sums["counts"]), 4)
        record["grad_norm"] = self.grad_norm / steps
        record["anchors_per_s"] = sums["anchors"] / max(self.seconds, 1e-9)
        record["tokens_per_s"] = sums["tokens"] / max(self.seconds, 1e-9)
        return record


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` (appended: one JSON record per log line, flushed at once) and,
    when ``tensorboard_dir`` is given and TensorBoard is installed, its scalars per stage."""

    TB_KEYS = ("loss", "ce", "kl", "tv", "lr", "tau_proxy", "grad_norm", "anchors_per_s")

    def __init__(self, path: Path, tensorboard_dir: Optional[Path] = None):
        self.file = open(path, "a", encoding="utf-8")
        self.tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                self.tb = None

    def write(self, record: dict[str, Any]) -> None:
        """One record with ``step`` (global) and ``stage``."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key in self.TB_KEYS:
                if key in record:
                    self.tb.add_scalar(f"{record['stage']}/{key}", record[key], record["step"])

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


__all__ = ["MetricWindow", "MetricsLog"]
