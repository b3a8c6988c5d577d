"""DLite training losses (paper Sec. 4.2, Eq. 6-7; DESIGN.md section 2).

Shapes: N anchors (rows), K block positions, V vocabulary. Block position ``i`` is 1-based in the
formulas (``i = 1..K``; tensor column ``i - 1``); column ``i - 1`` predicts ``x_{t+i}``.

* ``w_i = exp(-(i - 1) / gamma)``, gamma = 4 (:func:`position_weights`).
* ``mask [N, K]`` (bool) marks valid (anchor, position) pairs: a block that runs past the end of
  its sequence has invalid tail positions. Invalid pairs contribute nothing.

How terms are averaged (the contract every caller and the metrics rely on):

* :func:`ce_loss` is a token mean: ``sum_{n,i} m_{n,i} w_i CE_{n,i} / sum_{n,i} m_{n,i} w_i``
  (``w_i = 1`` unless ``weights`` is given). With uniform weights this is the usual mean token
  cross-entropy over valid labels; it does not grow with K.
* :func:`forward_kl` and :func:`tv_l1` follow the paper's per-anchor SUM over block positions and
  average over anchors: ``(1 / N') sum_n sum_i m_{n,i} w_i D_{n,i}`` with ``N'`` = number of
  anchors with at least one valid position. ``D_{n,i}`` is ``KL(p || q)`` in nats, resp.
  ``||p - q||_1`` (in [0, 2], no 1/2 factor: the paper's "TV").
* :func:`stable_loss` = ``0.1 * ce_loss(uniform) + 1.0 * tv_l1(w)``. The CE mean is per token while
  TV is summed over ~``sum_i w_i`` (3.7 for K = 7) positions per anchor, so CE is a light anchor on
  the label tokens, as the paper's lambda_CE = 0.1 intends.

All losses compute in fp32 (log-softmax of the fp32 logits); teacher logits / target
probabilities are treated as constants (detached). In data-parallel training each rank averages
its own rows and DDP averages the gradients, which equals the global average when every rank
holds the same number of rows (the trainer's batches do).
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
    block_size: int, gamma: float = DEFAULT_GAMMA, device: Optional[torch.device] = None
) -> torch.Tensor:
    """``[K]`` fp32: ``w_i = exp(-(i - 1) / gamma)`` for 1-based ``i`` (so ``w_1 = 1``)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    i = torch.arange(1, block_size + 1, dtype=torch.float32, device=device)
    return torch.exp(-(i - 1) / gamma)


def _mask_and_weights(
    logits: torch.Tensor, mask: Optional[torch.Tensor], weights: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = logits.shape[:2]
    m = (
        torch.ones(N, K, dtype=torch.float32, device=logits.device)
        if mask is None
        else mask.to(device=logits.device, dtype=torch.float32)
    )
    if m.shape != (N, K):
        raise ValueError(f"mask must be [N={N}, K={K}], got {tuple(m.shape)}")
    w = (
        torch.ones(K, dtype=torch.float32, device=logits.device)
        if weights is None
        else weights.to(device=logits.device, dtype=torch.float32)
    )
    if w.shape != (K,):
        raise ValueError(f"weights must be [K={K}], got {tuple(w.shape)}")
    return m, w


def _per_anchor_mean(per_pos: torch.Tensor, m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(1/N') sum_n sum_i m w D`` with ``N'`` = anchors with a valid position (>= 1)."""
    anchors = (m.sum(dim=1) > 0).sum().clamp_min(1)
    return (per_pos * m * w).sum() / anchors


def ce_loss(
    student_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Token cross-entropy, weighted token mean (see module docstring).

    student_logits ``[N, K, V]``, labels ``[N, K]`` int64 (any value where ``mask`` is False),
    mask ``[N, K]`` bool, weights ``[K]`` -> scalar. Returns 0 (with a graph) if nothing is valid.
    """
    m, w = _mask_and_weights(student_logits, mask, weights)
    safe_labels = torch.where(m > 0, labels.to(student_logits.device), 0)
    logp = F.log_softmax(student_logits.float(), dim=-1)  # [N, K, V]
    nll = -logp.gather(-1, safe_labels[..., None]).squeeze(-1)  # [N, K]
    mw = m * w
    return (nll * mw).sum() / mw.sum().clamp_min(1e-12)


def forward_kl(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Warm-up loss ``(1/N') sum_n sum_i w_i KL(p^H_{n,i} || q_{n,i})`` (nats).

    teacher_logits, student_logits ``[N, K, V]`` (teacher detached), weights ``[K]`` (usually
    :func:`position_weights`), mask ``[N, K]`` -> scalar.
    """
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher {tuple(teacher_logits.shape)} and student {tuple(student_logits.shape)} "
            "logits must have the same shape"
        )
    m, w = _mask_and_weights(student_logits, mask, weights)
    log_p = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [N, K]
    return _per_anchor_mean(kl, m, w)


def tv_l1(
    target_probs: torch.Tensor,
    student_logits: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Stable-stage distribution term ``(1/N') sum_n sum_i w_i ||p^T_{n,i} - q_{n,i}||_1``.

    target_probs ``[N, K, V]`` (the target's own next-token distribution at position ``t+i-1``,
    i.e. the one that predicted ``x_{t+i}``; detached), student_logits ``[N, K, V]``,
    weights ``[K]``, mask ``[N, K]`` -> scalar. No 1/2 factor (paper Eq. 7).
    """
    if target_probs.shape != student_logits.shape:
        raise ValueError(
            f"target_probs {tuple(target_probs.shape)} and student logits "
            f"{tuple(student_logits.shape)} must have the same shape"
        )
    m, w = _mask_and_weights(student_logits, mask, weights)
    q = torch.softmax(student_logits.float(), dim=-1)
    l1 = (target_probs.detach().float() - q).abs().sum(-1)  # [N, K]
    return _per_anchor_mean(l1, m, w)


def stable_loss(
    target_probs: torch.Tensor,
    student_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    gamma: float = DEFAULT_GAMMA,
    ce_weight: float = STABLE_CE_WEIGHT,
    tv_weight: float = STABLE_TV_WEIGHT,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``ce_weight * ce_loss + tv_weight * tv_l1(w(gamma))``; returns (loss, {"ce", "tv"})."""
    w = position_weights(student_logits.shape[1], gamma, device=student_logits.device)
    ce = ce_loss(student_logits, labels, mask)
    tv = tv_l1(target_probs, student_logits, w, mask)
    return ce_weight * ce + tv_weight * tv, {"ce": ce.detach(), "tv": tv.detach()}


@torch.no_grad()
def position_accuracy(
    student_logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced per-position top-1 agreement with the labels: ``(hits [K], counts [K])``.

    ``hits[i] / counts[i]`` estimates P(draft i correct | prefix correct); the chained product
    approximates the acceptance curve (greedy target, on-policy labels).
    """
    m, _ = _mask_and_weights(student_logits, mask, None)
    correct = (student_logits.argmax(-1) == labels.to(student_logits.device)).float() * m
    return correct.sum(0), m.sum(0)


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
    "ce_loss",
    "expected_tau",
    "forward_kl",
    "position_accuracy",
    "position_weights",
    "stable_loss",
    "tv_l1",
]
