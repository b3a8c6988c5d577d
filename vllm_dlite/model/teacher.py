"""The sliding-window teacher ``swa_teacher`` (training only; ``docs/dlite_v1.md`` §6).

Same backbone and sequential head as :class:`~vllm_dlite.model.drafter.DLiteDrafter` (same
parameter names, so the head can be copied into the student), plus HISTORY: a window of ``W-1``
fused history slots for the positions ``a-W .. a-2`` before the current feature position ``a-1``::

    h_p = RMSNorm_hist( W_hist [f_p(j_1) ; f_p(j_2) ; f_p(j_3)] )      W_hist: Linear(3H -> H, no bias)

over the target features of the 0-based target layers ``history_layer_ids`` (default
``[0, N//2, N-1]``; vLLM aux ids ``j+1``, pre-norm as served; like the drafter, the layer ``N-1``
feature goes through the target's final norm first). The context of one round is
``[h_{a-W} .. h_{a-2} ; c_1 .. c_L]`` (the current features' L slots "on top"); history slots are
context only (keys/values, never updated), exactly like the current slots.

RoPE ("absolute" positions): RoPE only sees offsets, so the slots keep their true distance to the
current features: the current slots sit where the student puts them (``max(g-2, 0)``), history
slot ``p`` sits ``(a-1) - p`` positions before them (``-1 .. -(W-1)`` for G = 1). One cos/sin
table serves every anchor. Slots for positions ``p < 0`` (or not supplied) are masked out.

Precise equivalences (tested): with ``window <= 1`` (no history slots) or with every history slot
masked, :meth:`SWATeacher.forward_train` computes exactly :meth:`DLiteDrafter.forward_train` of a
drafter holding the same shared weights.

Loss (the trainer): CE on the target's greedy tokens, the RNN fed the ground-truth previous tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite import ops
from vllm_dlite.config import DLiteConfig
from vllm_dlite.model.drafter import INIT_STD, DLiteDrafter, RMSNorm, rms_norm
from vllm_dlite.ops.reference import apply_rope

DEFAULT_WINDOW = 32
TEACHER_ONLY_PREFIXES = ("history_proj.", "history_norm.")
HEAD_PREFIX = "sequential_head."


def default_history_layer_ids(num_target_layers: int) -> list[int]:
    """``[0, N//2, N-1]`` (0-based target layers), de-duplicated for tiny N."""
    n = num_target_layers
    return sorted({0, n // 2, n - 1})


class SWATeacher(DLiteDrafter):
    """DLite backbone + head that also attends to ``window - 1`` fused history slots."""

    def __init__(self, config: DLiteConfig, *, window: int = DEFAULT_WINDOW,
                 history_layer_ids: Optional[Sequence[int]] = None):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"teacher window must be an integer >= 0 (W-1 history slots), got {window!r}")
        ids = list(history_layer_ids) if history_layer_ids is not None else \
            default_history_layer_ids(config.num_target_layers)
        if not ids or any(not 0 <= j < config.num_target_layers for j in ids):
            raise ValueError(f"history_layer_ids {ids} must be 0-based target layers in "
                             f"0..{config.num_target_layers - 1}")
        self._history_layer_ids = sorted(ids)
        self.window = window
        super().__init__(config)
        H = config.hidden_size
        self.history_proj = nn.Linear(len(self._history_layer_ids) * H, H, bias=False)
        self.history_norm = RMSNorm(H, config.rms_norm_eps)
        nn.init.normal_(self.history_proj.weight, std=INIT_STD)

    # ------------------------------------------------------------------ properties
    @property
    def history_layer_ids(self) -> list[int]:
        """0-based target layers fused into each history slot."""
        return list(self._history_layer_ids)

    @property
    def history_aux_ids(self) -> list[int]:
        """vLLM aux ids of :attr:`history_layer_ids` (``j + 1``)."""
        return [j + 1 for j in self._history_layer_ids]

    @property
    def num_history_slots(self) -> int:
        return max(0, self.window - 1)

    def student_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights shared with the student (everything but ``history_*``)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(TEACHER_ONLY_PREFIXES)}

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The sequential head's weights, under the student's names."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(HEAD_PREFIX)}

    # ------------------------------------------------------------------ history
    def fuse_history(self, history: torch.Tensor) -> torch.Tensor:
        """``[..., nh, H]`` features of :attr:`history_layer_ids` (aux convention, pre-norm)
        -> slots ``[..., H]`` = ``RMSNorm(Linear(concat))``."""
        nh, H = len(self._history_layer_ids), self.config.hidden_size
        if history.shape[-2:] != (nh, H):
            raise ValueError(f"history must be [..., {nh}, {H}] (layers {self._history_layer_ids}), "
                             f"got {tuple(history.shape)}")
        h = history.to(self.dtype)
        if self._history_layer_ids[-1] == self.config.num_target_layers - 1:
            _, final_norm = self._bound()
            last = rms_norm(h[..., -1, :], final_norm.to(self.dtype), self._final_norm_eps)
            h = torch.cat([h[..., :-1, :], last[..., None, :]], dim=-2)
        return self.history_norm(self.history_proj(h.flatten(-2)))

    def _rope_with_history(self, g: int, num_hist: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        ctx = max(g - 2, 0)
        positions = torch.cat([
            ctx - torch.arange(num_hist, 0, -1),  # history slot i (position a-1-(num_hist-i))
            torch.full((cfg.num_feature_layers,), ctx),
            torch.arange(g + cfg.num_draft_tokens),
        ])
        return ops.rope_cos_sin(positions.to(self.device), cfg.head_dim, cfg.rope_theta, dtype=self.dtype,
                                rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings)

    def backbone_with_history(self, features: torch.Tensor, group_ids: torch.Tensor,
                              history: Optional[torch.Tensor],
                              history_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Like :meth:`DLiteDrafter.backbone` with ``history [b, W-1, nh, H]`` (oldest first,
        the last slot = position ``a-2``) and ``history_valid [b, W-1]`` (False = masked)."""
        if history is None or history.shape[1] == 0:
            return self.backbone(features, group_ids)
        b, nslots = history.shape[:2]
        if nslots > self.num_history_slots:
            raise ValueError(f"history has {nslots} slots but the window allows {self.num_history_slots}")
        g = group_ids.shape[1]
        hist = self.fuse_history(history)  # [b, nslots, H]
        c = torch.cat([hist, self.context(features)], dim=1)  # [b, nslots + L, H]
        x = self.query(group_ids)
        cos, sin = self._rope_with_history(g, nslots)
        Q = x.shape[1]
        valid = torch.ones(b, c.shape[1] + Q, dtype=torch.bool, device=x.device)
        if history_valid is not None:
            valid[:, :nslots] = history_valid.to(x.device, torch.bool)
        mask = valid[:, None, None, :]  # [b, 1, 1, keys]
        cos4, sin4 = cos[None, :, None, :], sin[None, :, None, :]
        nctx = c.shape[1]
        for layer in self.layers:
            attn = layer.self_attn
            u = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(u).unflatten(-1, (attn.num_heads, attn.head_dim)))
            k_q, v_q = attn.keys_values(u)
            k_c, v_c = attn.keys_values(c)
            keys = apply_rope(torch.cat([k_c, k_q], dim=1), cos4, sin4)
            values = torch.cat([v_c, v_q], dim=1)
            q = apply_rope(q, cos4[:, nctx:], sin4[:, nctx:])
            group = attn.num_heads // attn.num_kv_heads
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.repeat_interleave(group, dim=2).transpose(1, 2),
                values.repeat_interleave(group, dim=2).transpose(1, 2), attn_mask=mask,
                scale=attn.scale,
            ).transpose(1, 2)
            x = x + attn.o_proj(out.flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)[:, g:]

    def forward_train(self, features: torch.Tensor, group_ids: torch.Tensor, labels: torch.Tensor,
                      return_readout: bool = False, history: Optional[torch.Tensor] = None,
                      history_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced forward (the student's, plus history): logits ``[b, K, V]`` fp32."""
        d = self.backbone_with_history(features, group_ids, history, history_valid)
        return self.head_teacher_forced(d, group_ids, labels, return_readout)

    forward = forward_train


def gather_history(rows: torch.Tensor, row_start: torch.Tensor, seq_index: torch.Tensor,
                   anchor_pos: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """History windows for a batch of anchors.

    rows ``[S, T', nh, H]``: per sequence, the history-layer features of positions
    ``row_start[s] .. row_start[s] + T' - 1`` (right-padded); ``seq_index [N]``, ``anchor_pos [N]``
    (a). Returns ``history [N, num_slots, nh, H]`` for positions ``a-num_slots-1 .. a-2`` (oldest
    first) and ``valid [N, num_slots]`` (False where the position is < 0 or not stored)."""
    N = anchor_pos.shape[0]
    if num_slots == 0:
        return rows.new_zeros(N, 0, *rows.shape[2:]), torch.zeros(N, 0, dtype=torch.bool, device=rows.device)
    offs = torch.arange(num_slots, 0, -1, device=anchor_pos.device) + 1  # num_slots+1 .. 2
    pos = anchor_pos[:, None] - offs  # [N, num_slots]: a-num_slots-1 .. a-2
    local = pos - row_start[seq_index][:, None]
    valid = (pos >= 0) & (local >= 0) & (local < rows.shape[1])
    gathered = rows[seq_index[:, None], local.clamp(0, rows.shape[1] - 1)]
    return gathered * valid[..., None, None].to(gathered.dtype), valid


__all__ = [
    "DEFAULT_WINDOW",
    "HEAD_PREFIX",
    "SWATeacher",
    "TEACHER_ONLY_PREFIXES",
    "default_history_layer_ids",
    "gather_history",
]
