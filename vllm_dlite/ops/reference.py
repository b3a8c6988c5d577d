"""PyTorch reference implementations of DLite's two per-round ops (format ``dlite_v1``).

These are the specification the CUDA kernels in ``csrc/`` must match (same signatures, shapes and
semantics); call them through :mod:`vllm_dlite.ops` so the dispatcher can pick a kernel.

Notation: b requests, L context slots (target layers), Q query slots (g real tokens then B-1 mask
slots), K = B-1 drafted tokens, h_q / h_kv query / key-value heads (GQA), D head dim, H width,
r head rank, V vocabulary.

RoPE (Qwen3 / HF "rotate-half"): ``inv_freq[j] = theta ** (-2j / D)``,
``cos = cat(cos(p * inv_freq), cos(p * inv_freq))`` (same for sin), computed in fp32 and cast to
the activation dtype before rotating (as HF does), ``rope(x) = x * cos + rotate_half(x) * sin``.
A checkpoint's ``rope_scaling`` changes ``inv_freq`` and scales cos/sin by an attention factor
(:func:`rope_inv_freq`, transformers 4.57's ``ROPE_INIT_FUNCTIONS``); the kernels take cos/sin as
inputs, so they need nothing more.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from vllm_dlite.ops.sampling import next_tokens


# ---------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_scaling: Optional[dict[str, Any]] = None,
    max_position_embeddings: int = 32768,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D/2] fp32, attention_scaling)`` as transformers 4.57's ``Qwen3RotaryEmbedding``
    initialises them from a config (``ROPE_INIT_FUNCTIONS[rope_type]``), for positions below
    ``max_position_embeddings`` (dynamic NTK only rescales past it; one DLite round's positions
    are < 64). ``rope_scaling`` None or rope_type ``default``: plain RoPE; ``linear``, ``dynamic``,
    ``yarn``, ``llama3``: the same float operations as theirs, in the same order."""
    dim = head_dim
    kind = "default" if not rope_scaling else rope_scaling.get("rope_type", rope_scaling.get("type", "default"))

    def default() -> torch.Tensor:
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))

    if kind == "default":
        return default(), 1.0
    factor = rope_scaling["factor"]
    if kind == "linear":
        inv_freq = default()
        inv_freq /= factor
        return inv_freq, 1.0
    if kind == "dynamic":  # initialised at seq_len = max_position_embeddings
        seq_len = max_position_embeddings
        base = theta * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)), 1.0
    if kind == "yarn":
        attention_factor = rope_scaling.get("attention_factor")
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        original = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings

        def get_mscale(scale, m=1):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        beta_fast = rope_scaling.get("beta_fast") or 32
        beta_slow = rope_scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope_scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
        inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv_freq, attention_factor
    if kind == "llama3":
        inv_freq = default()
        low_ff, high_ff = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling rope_type {kind!r} is not supported (default, linear, dynamic, "
                     "yarn, llama3): use a drafter trained with one of them")


def rope_cos_sin(
    positions: Union[int, torch.Tensor],
    head_dim: int,
    theta: float,
    *,
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float32,
    rope_scaling: Optional[dict[str, Any]] = None,
    max_position_embeddings: int = 32768,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)``, each ``[P, D]``, for ``positions`` (an int P means 0..P-1).
    Angles in fp32 (HF's ``Qwen3RotaryEmbedding``), times the attention factor of a scaled RoPE
    (:func:`rope_inv_freq`) in fp32, then cast to ``dtype``."""
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    pos = positions.to(device=device, dtype=torch.float32).reshape(-1)  # [P]
    if not rope_scaling:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.int64).float() / head_dim)
        )  # [D/2]
        scale = 1.0
    else:
        inv_freq, scale = rope_inv_freq(head_dim, theta, rope_scaling, max_position_embeddings)
        inv_freq = inv_freq.to(pos.device)
    angles = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, D]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in ``x.dtype``; cos/sin must broadcast against x."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------------------ draft attention
def draft_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_q: torch.Tensor,
    v_q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention of the Q query slots over ``[context ; query]`` (no mask).

    Args:
        q:       ``[b, Q, h_q, D]`` queries of the query slots (q-normed, BEFORE RoPE).
        k_ctx:   ``[b, L, h_kv, D]`` keys of the context slots (k-normed, before RoPE).
        v_ctx:   ``[b, L, h_kv, D]`` values of the context slots.
        k_q:     ``[b, Q, h_kv, D]`` keys of the query slots (k-normed, before RoPE).
        v_q:     ``[b, Q, h_kv, D]`` values of the query slots.
        cos/sin: ``[L+Q, D]`` RoPE rows of ``[context ; query]`` in that order (context rows all
                 hold the context position, query rows positions 0..Q-1; see the drafter).
        scale:   softmax scale (``D ** -0.5``).

    Returns:
        ``[b, Q, h_q, D]`` in ``q.dtype``. Query head h reads key/value head ``h // (h_q/h_kv)``.
        RoPE, scores and softmax run in ``q.dtype`` (HF SDPA semantics). Requests are independent.
    """
    b, Q, Hq, D = q.shape
    L, Hkv = k_ctx.shape[1], k_ctx.shape[2]
    if k_ctx.shape != (b, L, Hkv, D) or v_ctx.shape != k_ctx.shape:
        raise ValueError(f"k_ctx/v_ctx must be [b={b}, L, h_kv, D={D}], got "
                         f"{tuple(k_ctx.shape)} / {tuple(v_ctx.shape)}")
    if k_q.shape != (b, Q, Hkv, D) or v_q.shape != k_q.shape:
        raise ValueError(f"k_q/v_q must be [b={b}, Q={Q}, h_kv={Hkv}, D={D}], got "
                         f"{tuple(k_q.shape)} / {tuple(v_q.shape)}")
    if Hq % Hkv:
        raise ValueError(f"h_q={Hq} must be a multiple of h_kv={Hkv}")
    if cos.shape != (L + Q, D) or sin.shape != (L + Q, D):
        raise ValueError(f"cos/sin must be [L+Q={L + Q}, D={D}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    cos4, sin4 = cos[None, :, None, :], sin[None, :, None, :]  # [1, L+Q, 1, D]
    keys = apply_rope(torch.cat([k_ctx, k_q], dim=1), cos4, sin4)  # [b, L+Q, h_kv, D]
    values = torch.cat([v_ctx, v_q], dim=1)  # [b, L+Q, h_kv, D]
    q_rot = apply_rope(q, cos4[:, L:], sin4[:, L:])  # [b, Q, h_q, D]
    group = Hq // Hkv
    out = F.scaled_dot_product_attention(
        q_rot.transpose(1, 2),
        keys.repeat_interleave(group, dim=2).transpose(1, 2),
        values.repeat_interleave(group, dim=2).transpose(1, 2),
        scale=scale,
    )  # [b, h_q, Q, D]
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------ sequential head
def head_state_update(
    state: torch.Tensor, token_ids: torch.Tensor, prev_token_embedding: torch.Tensor,
    state_proj_weight: torch.Tensor, state_proj_bias: torch.Tensor,
) -> torch.Tensor:
    """Phi(s, t): ``e = P[t]``, ``[z ; c] = W_s [s ; e] + b_s``,
    ``s' = sigmoid(z) * s + (1 - sigmoid(z)) * tanh(c)``. ``state [b, r]`` -> ``[b, r]``."""
    r = state.shape[-1]
    e = F.embedding(token_ids, prev_token_embedding)  # [b, r]
    zc = F.linear(torch.cat([state, e], dim=-1), state_proj_weight, state_proj_bias)  # [b, 2r]
    gate = torch.sigmoid(zc[..., :r])
    return gate * state + (1 - gate) * torch.tanh(zc[..., r:])


def head_readout(
    state: torch.Tensor, d: torch.Tensor, hidden_mlp_weight: torch.Tensor,
    hidden_mlp_bias: torch.Tensor, output_proj_weight: Optional[torch.Tensor],
) -> torch.Tensor:
    """``o = W_f [s ; d] + b_f`` (``[.., r]``), then ``logits = W_o o`` (``[.., V]``); with
    ``output_proj_weight=None`` returns ``o`` (a trainer can project in chunks)."""
    o = F.linear(torch.cat([state, d], dim=-1), hidden_mlp_weight, hidden_mlp_bias)
    return o if output_proj_weight is None else F.linear(o, output_proj_weight)


def sequential_head(
    d: torch.Tensor,
    anchor_ids: torch.Tensor,
    prime_ids: Optional[torch.Tensor],
    prev_token_embedding: torch.Tensor,
    state_proj_weight: torch.Tensor,
    state_proj_bias: torch.Tensor,
    hidden_mlp_weight: torch.Tensor,
    hidden_mlp_bias: torch.Tensor,
    output_proj_weight: torch.Tensor,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    k: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated rank-r RNN head: drafts the block's tokens one after the other (``docs/dlite_v1.md`` §4)::

        s_0 = 0, or Phi(0, x_{a-1}) when prime_ids is given (G > 1)
        for j = 1..k:  s_j = Phi(s_{j-1}, t_{j-1})   (t_0 = x_a, t_j = token drafted at j)
                       logits_j = W_o (W_f [s_j ; d_j] + b_f)
                       t_j = argmax(logits_j)              if temperature < GREEDY_EPS (greedy)
                           ~ softmax(fp32 logits_j / T)    otherwise (torch.multinomial)

    Args:
        d:          ``[b, K, H]`` mask-slot outputs of the backbone (after the final norm).
        anchor_ids: ``[b]`` int64 anchor tokens ``x_a``.
        prime_ids:  ``[b]`` int64 ``x_{a-1}`` (G > 1) or None (zero initial state).
        prev_token_embedding ``[V, r]``; state_proj ``[2r, 2r]`` + ``[2r]``;
        hidden_mlp ``[r, r+H]`` + ``[r]``; output_proj ``[V, r]`` (the head's own tables).
        k:          tokens drafted this round, ``0 <= k <= K`` (default K): only the first k
                    steps run (later drafts would be thrown away).

    Returns:
        ``(draft_ids [b, k] int64, logits [b, k, V] fp32)``: raw logits (the draft
        distribution of a sampled row is ``softmax(logits / T)``). The recurrence runs in the
        dtype of the head's weights.
    """
    b, K, _ = d.shape
    k = K if k is None else int(k)
    if not 0 <= k <= K:
        raise ValueError(f"k (tokens drafted this round) must be in 0..{K}, got {k}")
    if anchor_ids.shape != (b,) or (prime_ids is not None and prime_ids.shape != (b,)):
        raise ValueError(f"anchor_ids / prime_ids must be [b={b}]")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    r = prev_token_embedding.shape[1]
    state = d.new_zeros(b, r, dtype=prev_token_embedding.dtype)
    if prime_ids is not None:
        state = head_state_update(state, prime_ids, prev_token_embedding, state_proj_weight, state_proj_bias)
    prev = anchor_ids
    draft_ids, logits = [], []
    for j in range(k):
        state = head_state_update(state, prev, prev_token_embedding, state_proj_weight, state_proj_bias)
        step = head_readout(state, d[:, j].to(state.dtype), hidden_mlp_weight, hidden_mlp_bias,
                            output_proj_weight).float()  # [b, V]
        prev = next_tokens(step, temperature, generator)  # greedy: argmax; else ~ softmax(step / T)
        draft_ids.append(prev)
        logits.append(step)
    if not draft_ids:
        return (anchor_ids.new_zeros(b, 0), d.new_zeros(b, 0, output_proj_weight.shape[0], dtype=torch.float32))
    return torch.stack(draft_ids, dim=1), torch.stack(logits, dim=1)


def sequential_head_teacher_forced(
    d: torch.Tensor,
    anchor_ids: torch.Tensor,
    prime_ids: Optional[torch.Tensor],
    forced_ids: torch.Tensor,
    prev_token_embedding: torch.Tensor,
    state_proj_weight: torch.Tensor,
    state_proj_bias: torch.Tensor,
    hidden_mlp_weight: torch.Tensor,
    hidden_mlp_bias: torch.Tensor,
    output_proj_weight: Optional[torch.Tensor],
) -> torch.Tensor:
    """Training form of :func:`sequential_head`: the RNN is fed ``x_a, forced_ids[:, 0], ...,
    forced_ids[:, K-2]`` (the labels ``x_{a+1..a+K}``; the last column is not an input);
    differentiable. Returns logits ``[b, K, V]`` fp32, or the readouts ``o [b, K, r]`` (head
    dtype) when ``output_proj_weight`` is None. Step k depends on ``forced_ids[:, :k]`` only."""
    b, K, _ = d.shape
    if anchor_ids.shape != (b,) or forced_ids.shape != (b, K):
        raise ValueError(f"anchor_ids must be [b={b}] and forced_ids [b={b}, K={K}], got "
                         f"{tuple(anchor_ids.shape)} / {tuple(forced_ids.shape)}")
    inputs = torch.cat([anchor_ids[:, None], forced_ids[:, : K - 1]], dim=1)  # [b, K]
    r = prev_token_embedding.shape[1]
    state = d.new_zeros(b, r, dtype=prev_token_embedding.dtype)
    if prime_ids is not None:
        state = head_state_update(state, prime_ids, prev_token_embedding, state_proj_weight, state_proj_bias)
    states = []
    for k in range(K):
        state = head_state_update(state, inputs[:, k], prev_token_embedding, state_proj_weight, state_proj_bias)
        states.append(state)
    out = head_readout(torch.stack(states, dim=1), d.to(state.dtype), hidden_mlp_weight,
                       hidden_mlp_bias, output_proj_weight)
    return out if output_proj_weight is None else out.float()


__all__ = [
    "apply_rope",
    "draft_attention",
    "head_readout",
    "head_state_update",
    "rope_cos_sin",
    "rope_inv_freq",
    "rotate_half",
    "sequential_head",
    "sequential_head_teacher_forced",
]
