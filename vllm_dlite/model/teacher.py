"""History-aware teacher (training only, paper Sec. 4.2).

Same feature elements, backbone layers, final norm and sequential head as :class:`DLiteDrafter`
(same parameter names), plus HISTORY: for an anchor at position t, every earlier position
``p <= t-1`` (within ``history_window``) contributes one extra key/value element

    hist_p = history_proj(cat_l norm_l(features[p, l])) + history_embedding

(``norm_l`` are the teacher's per-layer feature norms, shared with the local elements). History
elements, like the local feature elements, are context only: each layer projects them with its
own k/v projections and they are never updated.

RoPE positions (a choice; only relative offsets matter for RoPE): the local round keeps the
drafter's geometry shifted by t, i.e. feature elements at ``t``, anchor at ``t+1``, placeholder i at
``t+1+i``; history element p sits at ``p`` (<= t-1), i.e. just before the local features. Seen from
the block this is exactly the drafter's local layout (features at 0, block at 1..K) with history at
local positions ``p - t`` = -1, -2, ... Absolute positions let one history K/V tensor per sequence
serve every anchor of that sequence.

Batching for training: a whole sequence's features ``[T, L, Ht]`` are projected to history once per
layer; the anchors of each sequence are packed (padded to the largest per-sequence count) into one
SDPA call per layer with a boolean mask: the queries of anchor t see history ``t-W <= p <= t-1``
(``W = history_window``, None = unlimited) and their own ``L + K`` local elements only. History is
cropped to ``[min(t) - W, max(t) - 1]`` over the batch. Memory per layer ~
``S * (T_hist + Nmax * (L + K)) * Hq * D`` for K/V plus the ``[S, Nmax*K, T_hist + Nmax*(L+K)]``
mask; with ``T = 4096``, a few hundred anchors and ``W = 1024`` this stays bounded. With
``history_window=0`` the teacher computes exactly what the drafter computes.

No state is kept between calls. Embeddings/lm_head are shared with the target via
``bind_target`` exactly like the drafter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite import ops
from vllm_dlite.config import DLiteConfig
from vllm_dlite.model.drafter import INIT_STD, DLiteBase, DLiteDrafter, DraftAttention

HISTORY_PARAM_PREFIXES = ("history_proj.", "history_embedding")


class HistoryTeacher(DLiteBase):
    """DLite backbone + head that also attends to projected target features of earlier positions."""

    def __init__(
        self,
        config: DLiteConfig,
        *,
        history_window: Optional[int] = 1024,
        own_embed_tokens: bool = False,
        own_lm_head: bool = False,
    ):
        if history_window is not None and history_window < 0:
            raise ValueError(
                f"history_window must be >= 0 or None (unlimited), got {history_window}"
            )
        super().__init__(config, own_embed_tokens=own_embed_tokens, own_lm_head=own_lm_head)
        self.history_window = history_window
        L, Ht, H = config.num_feature_layers, config.target_hidden_size, config.hidden_size
        # one history element per earlier position: all L layer vectors, concatenated, projected
        self.history_proj = nn.Linear(L * Ht, H, bias=False)
        self.history_embedding = nn.Parameter(torch.zeros(H))
        nn.init.normal_(self.history_proj.weight, std=INIT_STD)
        nn.init.normal_(self.history_embedding, std=INIT_STD)

    @classmethod
    def from_drafter(
        cls, drafter: DLiteDrafter, *, history_window: Optional[int] = 1024
    ) -> "HistoryTeacher":
        """Fresh teacher with the drafter's config, embedding ownership and bound target weights,
        on the drafter's device and dtype (weights are NOT copied)."""
        teacher = cls(
            drafter.config,
            history_window=history_window,
            own_embed_tokens=drafter.embed_tokens is not None,
            own_lm_head=drafter.lm_head is not None,
        ).to(device=drafter.device, dtype=drafter.dtype)
        teacher._target_embed_weight = drafter._target_embed_weight
        teacher._target_lm_head_weight = drafter._target_lm_head_weight
        return teacher

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The teacher's weights that a :class:`DLiteDrafter` has (all but ``history_*``), e.g.
        to initialise DLite from a trained teacher:
        ``drafter.load_state_dict(teacher.drafter_state_dict())``."""
        return {
            k: v for k, v in self.state_dict().items() if not k.startswith(HISTORY_PARAM_PREFIXES)
        }

    # ------------------------------------------------------------------ history elements
    def embed_history(self, seq_features: torch.Tensor) -> torch.Tensor:
        """``[S, T, L, Ht]`` -> history elements ``[S, T, H]``."""
        S, T, L, Ht = seq_features.shape
        x = seq_features.to(self.dtype)
        if self.feature_norms is not None:
            x = torch.stack([norm(x[:, :, i]) for i, norm in enumerate(self.feature_norms)], dim=2)
        return self.history_proj(x.flatten(2)) + self.history_embedding

    # ------------------------------------------------------------------ training forward
    def forward_train(
        self,
        seq_features: torch.Tensor,
        seq_ids: torch.Tensor,
        seq_index: torch.Tensor,
        anchor_pos: torch.Tensor,
        target_block_ids: torch.Tensor,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Teacher-forced logits for N anchors drawn from S sequences.

        Args:
            seq_features:     ``[S, T, L, Ht]`` target features (vLLM aux convention) at every
                              position; row p is the residual stream that predicts token p+1.
            seq_ids:          ``[S, T]`` int64 tokens (only the anchors ``seq_ids[s, t]`` are read).
            seq_index:        ``[N]`` int64 sequence of each anchor.
            anchor_pos:       ``[N]`` int64 anchor position t (>= 1: the local features are at t-1).
            target_block_ids: ``[N, K]`` labels ``x_{t+1..t+K}`` (teacher forcing as the drafter).
            return_hidden:    return the normalised hidden ``[N, K, H]`` instead of logits.

        Returns:
            logits ``[N, K, V]`` fp32, in the order of the N anchors. Anchor t depends only on
            features at positions ``<= t-1`` (and the window), the anchor token and the labels.
        """
        cfg = self.config
        S, T = seq_ids.shape
        N, K = target_block_ids.shape
        if seq_features.shape != (S, T, cfg.num_feature_layers, cfg.target_hidden_size):
            raise ValueError(
                f"seq_features must be [S={S}, T={T}, L={cfg.num_feature_layers}, "
                f"Ht={cfg.target_hidden_size}], got {tuple(seq_features.shape)}"
            )
        if K != cfg.block_size or seq_index.shape != (N,) or anchor_pos.shape != (N,):
            raise ValueError(
                f"need seq_index [N], anchor_pos [N], target_block_ids [N, K={cfg.block_size}]; "
                f"got {tuple(seq_index.shape)}, {tuple(anchor_pos.shape)}, "
                f"{tuple(target_block_ids.shape)}"
            )
        if N == 0:
            raise ValueError("forward_train needs at least one anchor")
        if int(anchor_pos.min()) < 1 or int(anchor_pos.max()) >= T:
            raise ValueError(f"anchor positions must be in 1..{T - 1} (features at t-1 are needed)")

        # --- local inputs: exactly the drafter's (features at t-1, block [x_t, M, ...])
        anchor_ids = seq_ids[seq_index, anchor_pos]  # [N]
        context = self.embed_features(seq_features[seq_index, anchor_pos - 1])  # [N, Lz, H]
        block = self.embed_block(anchor_ids)  # [N, K, H]

        # --- history: crop to the positions any anchor may see, embed once per sequence
        window = self.history_window
        lo = 0 if window is None else max(0, int(anchor_pos.min()) - window)
        hi = int(anchor_pos.max())  # exclusive: p <= t-1 < max t
        history = self.embed_history(seq_features[:, lo:hi])  # [S, Th, H]
        hist_pos = torch.arange(lo, hi, device=history.device)  # [Th]

        # --- packing: anchor n goes to slot[n] of its sequence (padded to Nmax slots)
        packing = _Packing(seq_index, anchor_pos, S, hist_pos, window, K, context.shape[1])

        # --- RoPE tables at absolute positions (fp32; angles computed in fp64)
        D, theta = cfg.head_dim, cfg.rope_theta
        offsets = torch.arange(K + 1, device=block.device)
        cos_loc, sin_loc = ops.rope_cos_sin(anchor_pos[:, None] + offsets, D, theta)  # [N*(K+1), D]
        cos_loc, sin_loc = cos_loc.view(N, K + 1, 1, D), sin_loc.view(N, K + 1, 1, D)
        cos_hist, sin_hist = ops.rope_cos_sin(hist_pos, D, theta)  # [Th, D]
        rope = (cos_loc, sin_loc, cos_hist[:, None], sin_hist[:, None])

        for layer in self.layers:
            attn_in = layer.input_layernorm(block)
            block = block + self._attention(
                layer.self_attn, attn_in, context, history, rope, packing
            )
            block = block + layer.mlp(layer.post_attention_layernorm(block))
        return self.head_logits_teacher_forced(block, anchor_ids, target_block_ids, return_hidden)

    forward = forward_train

    def _attention(
        self,
        attn: DraftAttention,
        block: torch.Tensor,  # [N, K, H] normed
        context: torch.Tensor,  # [N, Lz, H]
        history: torch.Tensor,  # [S, Th, H]
        rope: tuple[torch.Tensor, ...],
        packing: "_Packing",
    ) -> torch.Tensor:
        cos_loc, sin_loc, cos_hist, sin_hist = rope
        N, K, _ = block.shape
        dtype = block.dtype
        # projections (pre-RoPE), then RoPE in fp32 at absolute positions
        q = attn.project_queries(block)  # [N, K, Hq, D]
        k_blk, v_blk = attn.project_keys_values(block)  # [N, K, Hkv, D]
        k_ctx, v_ctx = attn.project_keys_values(context)  # [N, Lz, Hkv, D]
        k_hist, v_hist = attn.project_keys_values(history)  # [S, Th, Hkv, D]
        q = ops.apply_rope(q.float(), cos_loc[:, 1:], sin_loc[:, 1:]).to(dtype)  # t+1+i
        k_blk = ops.apply_rope(k_blk.float(), cos_loc[:, 1:], sin_loc[:, 1:]).to(dtype)
        k_ctx = ops.apply_rope(k_ctx.float(), cos_loc[:, :1], sin_loc[:, :1]).to(dtype)  # t
        k_hist = ops.apply_rope(k_hist.float(), cos_hist, sin_hist).to(dtype)  # p

        # pack per sequence: queries [S, Nmax*K], keys [S, Th + Nmax*(Lz+K)]
        q_packed = packing.pack(q)  # [S, Nmax*K, Hq, D]
        k_packed = torch.cat([k_hist, packing.pack(torch.cat([k_ctx, k_blk], dim=1))], dim=1)
        v_packed = torch.cat([v_hist, packing.pack(torch.cat([v_ctx, v_blk], dim=1))], dim=1)
        group = attn.num_heads // attn.num_kv_heads
        k_packed = k_packed.repeat_interleave(group, dim=2)  # [S, Nk, Hq, D]
        v_packed = v_packed.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(
            q_packed.transpose(1, 2),
            k_packed.transpose(1, 2),
            v_packed.transpose(1, 2),
            attn_mask=packing.mask,
            scale=attn.scale,
        ).transpose(1, 2)  # [S, Nmax*K, Hq, D]
        out = packing.unpack(out, K)  # [N, K, Hq, D]
        return attn.o_proj(out.flatten(-2))


class _Packing:
    """Index bookkeeping that packs N anchors into S rows of Nmax slots, and the attention mask."""

    def __init__(
        self,
        seq_index: torch.Tensor,
        anchor_pos: torch.Tensor,
        num_seqs: int,
        hist_pos: torch.Tensor,
        window: Optional[int],
        block_size: int,
        num_context: int,
    ):
        device = seq_index.device
        N = seq_index.shape[0]
        counts = torch.bincount(seq_index, minlength=num_seqs)  # [S]
        self.num_slots = int(counts.max())
        order = torch.sort(seq_index, stable=True).indices
        starts = torch.cumsum(counts, 0) - counts  # first sorted index of each sequence
        slot = torch.empty_like(seq_index)
        slot[order] = torch.arange(N, device=device) - starts[seq_index[order]]
        self.seq_index, self.slot = seq_index, slot
        S, M, K, Lz = num_seqs, self.num_slots, block_size, num_context

        # anchor position per slot; padded slots get no history
        t_slot = torch.full((S, M), -1, dtype=torch.long, device=device)
        t_slot[seq_index, slot] = anchor_pos
        valid = t_slot >= 0
        p = hist_pos[None, None, :]  # [1, 1, Th]
        t = t_slot[:, :, None]  # [S, M, 1]
        hist_ok = valid[:, :, None] & (p <= t - 1)
        if window is not None:
            hist_ok &= p >= t - window  # [S, M, Th]
        # a slot sees its own Lz + K local elements (padded slots too: avoids all-masked rows)
        local_ok = torch.eye(M, dtype=torch.bool, device=device).repeat_interleave(Lz + K, dim=1)
        local_ok = local_ok[None].expand(S, M, M * (Lz + K))
        mask = torch.cat([hist_ok, local_ok], dim=2)  # [S, M, Th + M*(Lz+K)]
        self.mask = mask.repeat_interleave(K, dim=1)[:, None]  # [S, 1, M*K, Nk]
        self.num_seqs = S

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, n, ...] -> [S, M*n, ...]`` (zeros in padded slots)."""
        packed = x.new_zeros((self.num_seqs, self.num_slots) + tuple(x.shape[1:]))
        packed = packed.index_put((self.seq_index, self.slot), x)
        return packed.flatten(1, 2)

    def unpack(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``[S, M*n, ...] -> [N, n, ...]`` in anchor order."""
        return x.unflatten(1, (self.num_slots, n))[self.seq_index, self.slot]


__all__ = ["HistoryTeacher"]
