"""Initialisation and optimisation choices of the DLite training recipe, as functions of their
inputs that :class:`~vllm_dlite.train.trainer.Trainer` applies: how many target layers the drafter
reads when ``model.num_feature_layers`` is unset (:func:`default_num_feature_layers`), the mask
token when ``model.mask_token_id`` is unset (:func:`resolve_mask_token_id`), the sequential head
started at the target's ``lm_head`` (:func:`init_head_from_target`, ``model.head_init:
target_svd``), AdamW's weight-decay groups (:func:`param_groups`) and each stage's warm-up +
cosine learning-rate multiplier (:func:`lr_lambda`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def default_num_feature_layers(num_target_layers: int) -> int:
    """Paper: 14 of Qwen3-8B's 36 layers; the same fraction (at least 2) for other targets."""
    n = num_target_layers
    return min(n, max(2, round(14 * n / 36)))


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


@torch.no_grad()
def init_head_from_target(model: nn.Module, lm_head_weight: torch.Tensor) -> None:
    """Start the sequential head's readout at the target's lm_head, rank r: with
    ``lm_head[:V] = U S V^T``, ``output_proj = U_r S_r^(1/2)`` and the d-columns of
    ``state_hidden_mlp`` = ``S_r^(1/2) V_r^T``, so the logits start as ``U_r S_r V_r^T d``
    (plus the small random state term). Shapes and tensor names are unchanged."""
    head = model.sequential_head
    V, r = head.output_proj.weight.shape
    U, S, Vh = torch.linalg.svd(lm_head_weight[:V].float().cpu(), full_matrices=False)
    k = min(r, S.shape[0])
    root = S[:k].sqrt()
    head.output_proj.weight.zero_()
    head.output_proj.weight[:, :k].copy_((U[:, :k] * root).to(head.output_proj.weight))
    w = head.state_hidden_mlp.weight  # [r, r + H]: columns [:r] read the state, [r:] read d
    w[:, r:].zero_()
    w[:k, r:].copy_((root[:, None] * Vh[:k]).to(w))


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


__all__ = [
    "default_num_feature_layers",
    "init_head_from_target",
    "lr_lambda",
    "param_groups",
    "resolve_mask_token_id",
]
