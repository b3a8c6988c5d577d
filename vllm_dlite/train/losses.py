"""DLite training losses, the authors' recipe (``docs/dlite_v1.md`` §6; FlashMTP ``FC``).

Shapes: N anchors (rows), K = B-1 block positions, V vocabulary. Column ``k`` (0-based) is mask
slot ``k+1``, which predicts ``x_{a+k+1}``.

* Position weights ``w_k = exp(-k / gamma)`` with ``k`` the **0-based** offset (``w_0 = 1``),
  gamma = 4 (:func:`position_weights`).
* ``mask [N, K]`` (bool) marks the active (anchor, position) pairs; inactive pairs contribute
  nothing to the numerator or the normaliser.
* **Normaliser** = ``sum_{n,k} m_{n,k} w_k`` (the sum of the weights over the active positions;
  in data-parallel training it is summed over ranks: :func:`weighted_sum` returns the numerator,
  and the trainer divides by the all-reduced normaliser). So every loss here is a w-weighted mean
  over active positions:

  - teacher:  ``mean_w CE(logits, labels)``                                   (:func:`ce_loss`)
  - stage 1:  ``mean_w KL(p_teacher || q_student)``                            (:func:`forward_kl`)
  - stage 2:  ``lambda_CE * mean_w CE + lambda_TV * mean_w ||q - p||_1``        (:func:`stable_loss`)
    with ``p`` the target's teacher-forced distribution at positions ``a..a+B-2`` (the one that
    predicted ``x_{a+k+1}``) and the L1 distance WITHOUT the 1/2 factor (in [0, 2]);
    paper: lambda_CE = 0.1, lambda_TV = 1.

All terms compute in fp32 (log-softmax of fp32 logits); teacher logits and target probabilities are
constants (detached).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

DEFAULT_GAMMA = 4.0
STABLE_CE_WEIGHT = 0.1
STABLE_TV_WEIGHT = 1.0


def position_weights(
    num_positions: int, gamma: float = DEFAULT_GAMMA, device: Optional[torch.device] = None
) -> torch.Tensor:
    """``[K]`` fp32: ``w_k = exp(-k / gamma)`` for the 0-based offset ``k`` (``w_0 = 1``);
    ``gamma = inf`` gives uniform weights."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(num_positions, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def _mask_weights(shape: tuple[int, int], device, mask: Optional[torch.Tensor],
                  weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N, K]`` fp32 ``m * w``."""
    N, K = shape
    m = torch.ones(N, K, device=device) if mask is None else mask.to(device=device, dtype=torch.float32)
    if m.shape != (N, K):
        raise ValueError(f"mask must be [N={N}, K={K}], got {tuple(m.shape)}")
    w = torch.ones(K, device=device) if weights is None else weights.to(device=device, dtype=torch.float32)
    if w.shape != (K,):
        raise ValueError(f"weights must be [K={K}], got {tuple(w.shape)}")
    return m * w


def normaliser(mask: Optional[torch.Tensor], weights: torch.Tensor, num_rows: Optional[int] = None
               ) -> torch.Tensor:
    """``sum_{n,k} m_{n,k} w_k`` (fp32 scalar); ``mask=None`` means all ``num_rows`` rows active."""
    w = weights.float()
    if mask is None:
        return w.sum() * float(num_rows or 0)
    return (mask.float() * w).sum()


# ------------------------------------------------------------------ per-position terms [N, K]
def ce_per_position(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy ``-log q(label)`` per (anchor, position), fp32 ``[N, K]``."""
    logq = F.log_softmax(logits.float(), dim=-1)
    return -logq.gather(-1, labels.to(logits.device).clamp_min(0)[..., None]).squeeze(-1)


def kl_per_position(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_teacher || q_student)`` in nats per (anchor, position), fp32 ``[N, K]``."""
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher {tuple(teacher_logits.shape)} and student "
                         f"{tuple(student_logits.shape)} logits must have the same shape")
    log_p = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def l1_per_position(target_probs: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """``||q - p||_1`` (no 1/2 factor, in [0, 2]) per (anchor, position), fp32 ``[N, K]``."""
    if target_probs.shape != student_logits.shape:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} and student logits "
                         f"{tuple(student_logits.shape)} must have the same shape")
    q = torch.softmax(student_logits.float(), dim=-1)
    return (q - target_probs.detach().float()).abs().sum(-1)


def weighted_sum(per_position: torch.Tensor, mask: Optional[torch.Tensor] = None,
                 weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Numerator ``sum_{n,k} m_{n,k} w_k D_{n,k}`` (divide by :func:`normaliser`)."""
    mw = _mask_weights(tuple(per_position.shape), per_position.device, mask, weights)
    return (per_position * mw).sum()


def _weighted_mean(per_position, mask, weights) -> torch.Tensor:
    mw = _mask_weights(tuple(per_position.shape), per_position.device, mask, weights)
    return (per_position * mw).sum() / mw.sum().clamp_min(1e-12)


# ------------------------------------------------------------------ the losses (w-weighted means)
def ce_loss(logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor] = None,
            weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum m w CE / sum m w`` (``weights=None``: uniform, i.e. the plain token mean)."""
    return _weighted_mean(ce_per_position(logits, labels), mask, weights)


def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
               weights: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stage 1: ``sum m w KL(p_teacher || q) / sum m w``."""
    return _weighted_mean(kl_per_position(teacher_logits, student_logits), mask, weights)


def tv_l1(target_probs: torch.Tensor, student_logits: torch.Tensor,
          weights: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum m w ||q - p||_1 / sum m w`` (no 1/2 factor)."""
    return _weighted_mean(l1_per_position(target_probs, student_logits), mask, weights)


def stable_loss(target_probs: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor,
                mask: Optional[torch.Tensor] = None, gamma: float = DEFAULT_GAMMA,
                ce_weight: float = STABLE_CE_WEIGHT, tv_weight: float = STABLE_TV_WEIGHT,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 2: ``ce_weight * mean_w CE + tv_weight * mean_w L1`` with ``w = exp(-k/gamma)``;
    returns ``(loss, {"ce", "tv"})`` (the parts detached)."""
    w = position_weights(student_logits.shape[1], gamma, device=student_logits.device)
    ce = ce_loss(student_logits, labels, mask, w)
    tv = tv_l1(target_probs, student_logits, w, mask)
    return ce_weight * ce + tv_weight * tv, {"ce": ce.detach(), "tv": tv.detach()}


# ------------------------------------------------------------------ metrics
@torch.no_grad()
def position_accuracy(student_logits: torch.Tensor, labels: torch.Tensor,
                      mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced per-position top-1 agreement with the labels: ``(hits [K], counts [K])``."""
    m = _mask_weights(tuple(labels.shape), student_logits.device, mask, None)
    correct = (student_logits.argmax(-1) == labels.to(student_logits.device)).float() * m
    return correct.sum(0).cpu(), m.sum(0).cpu()


def expected_tau(hits: torch.Tensor, counts: torch.Tensor) -> float:
    """``1 + sum_i prod_{j<=i} acc_j`` from :func:`position_accuracy` totals (a proxy for tau)."""
    acc = (hits / counts.clamp_min(1)).tolist()
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau if math.isfinite(tau) else float("nan")


__all__ = [
    "DEFAULT_GAMMA",
    "STABLE_CE_WEIGHT",
    "STABLE_TV_WEIGHT",
    "ce_loss",
    "ce_per_position",
    "expected_tau",
    "forward_kl",
    "kl_per_position",
    "l1_per_position",
    "normaliser",
    "position_accuracy",
    "position_weights",
    "stable_loss",
    "tv_l1",
    "weighted_sum",
]
