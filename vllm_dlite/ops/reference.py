"""PyTorch reference implementations of DLite's two per-round ops.

These are the specification a CUDA kernel must match (same signatures, shapes and semantics);
call them through :mod:`vllm_dlite.ops` so that a dispatcher can swap in the kernel later.

Notation: B requests, K block size (= num_speculative_tokens), L feature elements (L target layers
in "sequence" mode, 1 in "feature" mode), Hq / Hkv query / key-value heads (GQA, Hq % Hkv == 0),
D head dim, H draft width, r head rank, V vocabulary size.

RoPE convention (Qwen3 / HF "rotate-half"): for a position p,
``inv_freq[j] = theta ** (-2j / D)`` for ``j < D/2``,
``cos = cat(cos(p*inv_freq), cos(p*inv_freq))`` (same for sin),
``rope(x) = x * cos + rotate_half(x) * sin``,
``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``.

Local positions of one DLite round: the L feature elements all sit at position 0, block offset i
(0 = anchor, 1..K-1 = mask placeholders) at position 1 + i.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(
    positions: Union[int, torch.Tensor],
    head_dim: int,
    theta: float,
    *,
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)``, each ``[P, D]``, for ``positions`` (an int P means 0..P-1).

    Angles are computed in float64 so that large absolute positions (the training teacher) keep
    full fp32 accuracy. Positions may be negative.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    pos = positions.to(device=device, dtype=torch.float64).reshape(-1)  # [P]
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float64) / head_dim
    )  # [D/2]
    angles = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``; cos/sin must broadcast against x."""
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------------------ draft attention
def draft_attention(
    q: torch.Tensor,
    k_feat: torch.Tensor,
    v_feat: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Non-causal attention of the K block queries over ``[feature elements ; block]``.

    Args:
        q:       ``[B, K, Hq, D]`` block queries (after q-norm, BEFORE RoPE).
        k_feat:  ``[B, L, Hkv, D]`` keys of the feature elements (after k-norm, before RoPE);
                 all at local position 0.
        v_feat:  ``[B, L, Hkv, D]`` values of the feature elements.
        k_block: ``[B, K, Hkv, D]`` keys of the block (after k-norm, before RoPE); offset i at
                 local position 1 + i.
        v_block: ``[B, K, Hkv, D]`` values of the block.
        cos/sin: ``[K+1, D]`` RoPE tables for local positions 0..K (:func:`rope_cos_sin`).
        scale:   softmax scale (normally ``D ** -0.5``).

    Returns:
        ``[B, K, Hq, D]`` in ``q.dtype``. Query head h reads key/value head ``h // (Hq // Hkv)``.
        RoPE, scores, softmax and the weighted sum are computed in fp32. No mask: every query sees
        all ``L + K`` keys. Each request is independent of the others in the batch.
    """
    B, K, Hq, D = q.shape
    L, Hkv = k_feat.shape[1], k_feat.shape[2]
    if k_feat.shape != (B, L, Hkv, D) or v_feat.shape != k_feat.shape:
        raise ValueError(
            f"k_feat/v_feat must be [B={B}, L, Hkv, D={D}], got "
            f"{tuple(k_feat.shape)} / {tuple(v_feat.shape)}"
        )
    if k_block.shape != (B, K, Hkv, D) or v_block.shape != k_block.shape:
        raise ValueError(
            f"k_block/v_block must be [B={B}, K={K}, Hkv={Hkv}, D={D}], got "
            f"{tuple(k_block.shape)} / {tuple(v_block.shape)}"
        )
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if cos.shape != (K + 1, D) or sin.shape != (K + 1, D):
        raise ValueError(
            f"cos/sin must be [K+1={K + 1}, D={D}], got {tuple(cos.shape)} / {tuple(sin.shape)}"
        )

    cos = cos.float()
    sin = sin.float()
    cos_feat, sin_feat = cos[0][None, None, None, :], sin[0][None, None, None, :]  # position 0
    cos_block, sin_block = cos[1:][None, :, None, :], sin[1:][None, :, None, :]  # positions 1..K

    q_rot = apply_rope(q.float(), cos_block, sin_block)  # [B, K, Hq, D]
    keys = torch.cat(
        [
            apply_rope(k_feat.float(), cos_feat, sin_feat),
            apply_rope(k_block.float(), cos_block, sin_block),
        ],
        dim=1,
    )  # [B, L+K, Hkv, D]
    values = torch.cat([v_feat.float(), v_block.float()], dim=1)  # [B, L+K, Hkv, D]
    group = Hq // Hkv
    keys = keys.repeat_interleave(group, dim=2)  # [B, L+K, Hq, D]
    values = values.repeat_interleave(group, dim=2)

    out = F.scaled_dot_product_attention(
        q_rot.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale=scale
    )  # [B, Hq, K, D]
    return out.transpose(1, 2).to(q.dtype)


# ------------------------------------------------------------------------------ sequential head
def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _head_logits(
    h_tilde: torch.Tensor, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``lm_head(rmsnorm(h~))`` -> fp32 logits. The vocab matmul runs in lm_head's dtype."""
    normed = _rms_norm_fp32(h_tilde, norm_weight, eps).to(lm_head_weight.dtype)
    return F.linear(normed, lm_head_weight).float()


def sequential_head(
    h: torch.Tensor,
    anchor_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    w_in: torch.Tensor,
    w_state: torch.Tensor,
    w_out: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    eps: float,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    forced_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-rank sequential head: drafts the K block tokens one after the other.

    For block offset ``i = 0..K-1`` (``x_t`` = anchor, ``x_{t+i}`` = token drafted at step i-1)::

        s_{-1} = 0
        s_i    = tanh(w_state @ s_{i-1} + w_in @ E(x_{t+i}))      # g(s, e), rank r, no bias
        h~_i   = h_i + w_out @ s_i
        logits_i = lm_head(rmsnorm(h~_i; norm_weight, eps))
        x_{t+i+1} = argmax(logits_i)            if temperature == 0
                  ~ softmax(logits_i / T)        otherwise (torch.multinomial with ``generator``)

    With ``w_out = 0`` (its initial value) the head equals the parallel backbone's
    ``lm_head(norm(h_i))``.

    Args:
        h:              ``[B, K, H]`` backbone output (pre final norm).
        anchor_ids:     ``[B]`` int64 anchor tokens ``x_t``.
        embed_weight:   ``[V', H]`` token embedding E (V' >= every id used).
        w_in:           ``[r, H]``; w_state: ``[r, r]``; w_out: ``[H, r]`` (nn.Linear layout).
        norm_weight:    ``[H]`` final RMSNorm weight.
        lm_head_weight: ``[V, H]``.
        eps:            RMSNorm epsilon.
        temperature:    0 = greedy; > 0 samples from ``softmax(logits / temperature)``.
        generator:      optional ``torch.Generator`` for sampling.
        forced_ids:     optional ``[B, K]`` teacher forcing: step i>0 feeds ``forced_ids[:, i-1]``
                        instead of the drafted token (column K-1 is unused). Drafted ids are still
                        returned (the model's own choice at every position).

    Returns:
        ``(draft_ids [B, K] int64, logits [B, K, V] fp32)``; logits are raw (before temperature),
        so the draft distribution is ``softmax(logits / T)``. The recurrence and the norm run in
        fp32; the vocab matmul runs in ``lm_head_weight.dtype``.
    """
    B, K, H = h.shape
    r = w_in.shape[0]
    if anchor_ids.shape != (B,):
        raise ValueError(f"anchor_ids must be [B={B}], got {tuple(anchor_ids.shape)}")
    if forced_ids is not None and forced_ids.shape != (B, K):
        raise ValueError(f"forced_ids must be [B={B}, K={K}], got {tuple(forced_ids.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    w_in32, w_state32, w_out32 = w_in.float(), w_state.float(), w_out.float()

    state = h.new_zeros(B, r, dtype=torch.float32)  # s_{-1}
    prev_ids = anchor_ids
    draft_ids, logits = [], []
    for i in range(K):
        emb = F.embedding(prev_ids, embed_weight).float()  # [B, H]
        state = torch.tanh(state @ w_state32.T + emb @ w_in32.T)  # [B, r]
        h_tilde = h[:, i].float() + state @ w_out32.T  # [B, H]
        step_logits = _head_logits(h_tilde, norm_weight, lm_head_weight, eps)  # [B, V]
        if temperature == 0.0:
            step_ids = step_logits.argmax(dim=-1)
        else:
            probs = torch.softmax(step_logits / temperature, dim=-1)
            step_ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        draft_ids.append(step_ids)
        logits.append(step_logits)
        prev_ids = step_ids if forced_ids is None else forced_ids[:, i]
    return torch.stack(draft_ids, dim=1), torch.stack(logits, dim=1)


def sequential_head_teacher_forced(
    h: torch.Tensor,
    anchor_ids: torch.Tensor,
    forced_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    w_in: torch.Tensor,
    w_state: torch.Tensor,
    w_out: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: Optional[torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """Training form of :func:`sequential_head`: teacher-forced, no sampling, differentiable.

    Same recurrence with inputs ``[anchor, forced_ids[:, 0], ..., forced_ids[:, K-2]]``; since the
    inputs are known, the K embeddings and their ``w_in`` projections are computed in one batch and
    only the rank-r recurrence loops over K. Logits at offset i depend on ``forced_ids[:, :i]``
    only (causal).

    Args: as :func:`sequential_head`; ``forced_ids [B, K]`` = the block labels
        ``x_{t+1..t+K}`` (column K-1 is not an input).
        ``lm_head_weight=None`` returns the normalised hidden ``rmsnorm(h~)`` ``[B, K, H]`` fp32
        instead of logits, so a trainer can apply the vocab projection + loss in chunks.

    Returns:
        ``logits [B, K, V]`` fp32 (or ``[B, K, H]`` fp32, see above).
    """
    B, K, H = h.shape
    if anchor_ids.shape != (B,) or forced_ids.shape != (B, K):
        raise ValueError(
            f"anchor_ids must be [B={B}] and forced_ids [B={B}, K={K}], got "
            f"{tuple(anchor_ids.shape)} / {tuple(forced_ids.shape)}"
        )
    inputs = torch.cat([anchor_ids[:, None], forced_ids[:, : K - 1]], dim=1)  # [B, K]
    drive = F.embedding(inputs, embed_weight).float() @ w_in.float().T  # [B, K, r]
    w_state32 = w_state.float()
    state = drive.new_zeros(B, w_in.shape[0])  # s_{-1}
    states = []
    for i in range(K):
        state = torch.tanh(state @ w_state32.T + drive[:, i])  # [B, r]
        states.append(state)
    h_tilde = h.float() + torch.stack(states, dim=1) @ w_out.float().T  # [B, K, H]
    if lm_head_weight is None:
        return _rms_norm_fp32(h_tilde, norm_weight, eps)
    return _head_logits(h_tilde, norm_weight, lm_head_weight, eps)


__all__ = [
    "apply_rope",
    "draft_attention",
    "rope_cos_sin",
    "rotate_half",
    "sequential_head",
    "sequential_head_teacher_forced",
]
