"""The DLite drafter, format ``dlite_v1`` (paper Sec. 4; ``docs/dlite_v1.md`` §§2-4).

One round for a request whose anchor ``x_a`` (the token the target just produced) sits at
position ``a``; ``f[l]`` = the target's features at position ``a-1`` from layer
``target_layer_ids[l]`` (vLLM aux id ``j+1``, pre-norm; the last one goes through the target's
final norm here, as the authors read it from HF's post-norm last hidden state)::

    c_l  = RMSNorm_ctx(f_l + E_depth[target_layer_ids[l]])        # L context slots, never updated
    g    = min(G, a+1);  X = [E(x_{a-g+1}) .. E(x_a), E(m) x (B-1)] # Q = g + B - 1 query slots
    RoPE positions: query slot i at i, every context slot at max(g-2, 0)
    for each of the n layers (Qwen3, bidirectional, no mask):
        u = RMSNorm_in(X)
        X = X + Attn(q = u, k/v = [c ; u])
        X = X + SwiGLU(RMSNorm_post(X))
    d_1..d_{B-1} = RMSNorm_final(X)[g:]                            # mask slot k predicts x_{a+k}

    sequential head (gated rank-r RNN, its own [V, r] embedding P and [V, r] projection W_o):
    s_0 = 0, or Phi(0, x_{a-1}) if G > 1;  s_k = Phi(s_{k-1}, t_{k-1}), t_0 = x_a
    logits_k = W_o (W_f [s_k ; d_k] + b_f);   t_k = argmax / sample(logits_k / T)

The target's lm_head is never used. Only the target's token embedding (for the real tokens and
the mask slots) and its final norm (for the last feature) are shared: :meth:`bind_target`.

Contract:
* No state between calls: a draft depends only on its request's ``(features, group tokens)``.
* ``group_ids [b, g]`` are the real tokens ``x_{a-g+1}..x_a`` (anchor last); all rows of one call
  share g (the vLLM draft model groups a ragged batch by g). With G > 1, ``x_{a-1}`` also primes
  the head, so g >= 2 is required (a >= 1 always holds after a prompt of >= 1 token).
* Everything runs in the module's dtype (bf16 for the authors' checkpoints, fp32 on CPU); logits
  are returned as fp32. Features may arrive in any float dtype.
* Parameter names are the authors' tensor names (so ``state_dict`` is the checkpoint);
  :mod:`vllm_dlite.model.checkpoint` saves and loads them (it imports this module, never the
  reverse).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite import ops
from vllm_dlite.config import DLiteConfig

INIT_STD = 0.02


class DraftOutput(NamedTuple):
    token_ids: torch.Tensor  # [b, k] int64: drafted x_{a+1..a+k}
    logits: torch.Tensor  # [b, k, V] fp32, raw (the draft distribution is softmax(logits / T))


# =========================================================================== the anchor group
def anchor_group(
    anchors: torch.Tensor,
    rows: torch.Tensor,
    step_tokens: torch.Tensor,
    G: int,
    step_positions: Optional[torch.Tensor] = None,
    query_start: Optional[torch.Tensor] = None,
    history: Optional[torch.Tensor] = None,
    history_rows: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The real query tokens of a batch of rounds, ``x_{a-G+1} .. x_a`` (anchor last), from what
    a serving engine holds: this step's flattened input and each request's token history.

    Args:
        anchors: ``[B]`` x_a, the token each request's round drafts after.
        rows: ``[B]`` the row of ``step_tokens`` at position ``a-1`` (the row that predicted the
            anchor: always scheduled this step).
        step_tokens: ``[N]`` this step's input token ids (requests' rows contiguous).
        G: the drafter's ``anchor_group_size``. G <= 2 needs nothing more and never syncs
            with the host (``x_{a-1}`` is ``step_tokens[rows]``).
        step_positions: ``[N]`` the rows' positions (G > 2).
        query_start: ``[B]`` each request's first row in ``step_tokens`` (G > 2).
        history: ``[R, T]`` token ids by history row and position, complete for every position
            scheduled before this step (G > 2; may live on another device).
        history_rows: ``[B]`` each request's row of ``history`` (G > 2).

    Returns ``(group [B, G] int64, lens)``: ``lens [B]`` (CPU) = ``min(G, a+1)`` real tokens per
    row, the unused left slots holding 0, or None when every row has G (always for G <= 2, since
    ``a >= 1``). Position ``a-j`` is read from this step's input when the request scheduled it
    this step, else from its history (one host sync for G > 2).
    """
    anchors = anchors.long()
    if G == 1:
        return anchors[:, None], None
    if G == 2:
        return torch.stack([step_tokens[rows].long(), anchors], dim=1), None
    if step_positions is None or query_start is None:
        raise ValueError("anchor_group with G > 2 needs this step's positions and each request's first row")
    back = torch.arange(G - 2, -1, -1, device=rows.device)  # [G-1]: a-1 - pos, for x_{a-G+1} .. x_{a-1}
    previous = step_positions[rows].long()  # [B] a-1
    pos = previous[:, None] - back  # [B, G-1]
    in_step = (pos >= step_positions[query_start].long()[:, None]) | (pos < 0)  # scheduled this step (or none)
    earlier = step_tokens[(rows.long()[:, None] - back).clamp(min=0)].long()  # [B, G-1]
    if not bool(in_step.all()):  # host sync
        if history is None or history_rows is None:
            raise ValueError("anchor_group with G > 2 reaches before this step: it needs the token history")
        at = (history_rows.long()[:, None].to(history.device), pos.clamp(min=0).to(history.device))
        earlier = torch.where(in_step, earlier, history[at].long().to(earlier.device))
    group = torch.cat([earlier, anchors[:, None]], dim=1)
    lens = (previous + 2).clamp(max=G).cpu()  # min(G, a+1)
    if bool((lens == G).all()):
        return group, None
    group[:, :-1] = torch.where(pos >= 0, earlier, 0)
    return group, lens


# =========================================================================== building blocks
class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, cast back to the input dtype, then scale by ``weight``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The one RMSNorm of the package (HF ``Qwen3RMSNorm`` semantics)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class DraftAttention(nn.Module):
    """Qwen3 attention (q/k-norm per head, GQA): queries from the query slots, keys/values from
    ``[context ; query]``; RoPE and the softmax run in :func:`vllm_dlite.ops.draft_attention`."""

    def __init__(self, cfg: DLiteConfig):
        super().__init__()
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.scale = D**-0.5
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, n, H]`` -> k (k-normed, pre-RoPE), v: ``[b, n, h_kv, D]``."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return k, self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(self, u: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """u ``[b, Q, H]`` (normed query slots), context ``[b, L, H]``, cos/sin ``[L+Q, D]``."""
        q = self.q_norm(self.q_proj(u).unflatten(-1, (self.num_heads, self.head_dim)))  # [b, Q, h_q, D]
        k_q, v_q = self.keys_values(u)  # [b, Q, h_kv, D]
        k_c, v_c = self.keys_values(context)  # [b, L, h_kv, D]
        out = ops.draft_attention(q, k_c, v_c, k_q, v_q, cos, sin, self.scale)  # [b, Q, h_q, D]
        return self.o_proj(out.flatten(-2))


def activation(name: str):
    """transformers' ``ACT2FN[name]`` (4.57) as a function, for the activations
    :data:`vllm_dlite.config.ACTIVATIONS` lists (the same float operations)."""
    def gelu_tanh_formula(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    table = {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_python_tanh": gelu_tanh_formula,
        "gelu_new": gelu_tanh_formula,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "relu": F.relu,
        "relu2": lambda x: torch.square(F.relu(x)),
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
    }
    if name not in table:
        raise ValueError(f"hidden_act {name!r} is not supported by the DLite draft MLP: use one of {sorted(table)}")
    return table[name]


class SwiGLU(nn.Module):
    """Qwen3's MLP: ``down(act(gate(x)) * up(x))``, ``act`` = the config's ``hidden_act`` (SiLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer over the query slots; the context is read, never updated."""

    def __init__(self, cfg: DLiteConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SequentialHead(nn.Module):
    """Gated rank-r RNN head (authors' ``sequential_head.*`` tensors): ``prev_token_embedding``
    P ``[V, r]``, ``state_proj`` W_s ``[2r, 2r]`` + b_s, ``state_hidden_mlp`` W_f ``[r, r+H]`` +
    b_f, ``output_proj`` W_o ``[V, r]``."""

    def __init__(self, hidden_size: int, rank: int, vocab_size: int):
        super().__init__()
        self.prev_token_embedding = nn.Embedding(vocab_size, rank)
        self.state_proj = nn.Linear(2 * rank, 2 * rank)
        self.state_hidden_mlp = nn.Linear(rank + hidden_size, rank)
        self.output_proj = nn.Linear(rank, vocab_size, bias=False)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The head's weights in :func:`vllm_dlite.ops.sequential_head` argument order."""
        return (self.prev_token_embedding.weight, self.state_proj.weight, self.state_proj.bias,
                self.state_hidden_mlp.weight, self.state_hidden_mlp.bias, self.output_proj.weight)


# =========================================================================== the drafter
class DLiteDrafter(nn.Module):
    """History-free DLite drafter (``dlite_v1``). See the module docstring for the contract."""

    def __init__(self, config: DLiteConfig):
        super().__init__()
        self.config = cfg = config.validate()
        H = cfg.hidden_size
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.context_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layer_depth_embedding = nn.Embedding(cfg.num_target_layers, H)
        self.sequential_head = SequentialHead(H, cfg.sequential_rank, cfg.vocab_size)
        self.register_buffer("layer_ids", torch.tensor(cfg.target_layer_ids), persistent=False)
        self._embed_weight: Optional[torch.Tensor] = None  # target's [V', H]
        self._final_norm_weight: Optional[torch.Tensor] = None  # target's [H]
        self._final_norm_eps = cfg.rms_norm_eps
        self._rope_cache: dict = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF-style init: N(0, 0.02) for matrices and embeddings, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ target weights
    def bind_target(self, embed_weight: torch.Tensor, final_norm_weight: torch.Tensor,
                    final_norm_eps: float) -> None:
        """Share the target's token embedding ``[V' >= V, H]`` and final-norm weight ``[H]``
        (references, not copies, not saved). Bind after the target is on its final device."""
        V, H = self.config.vocab_size, self.config.hidden_size
        if embed_weight.dim() != 2 or embed_weight.shape[1] != H or embed_weight.shape[0] < V:
            raise ValueError(f"bind_target: the target's embedding must be [>= {V}, {H}], got "
                             f"{tuple(embed_weight.shape)}: use a drafter trained for this target")
        if final_norm_weight.shape != (H,):
            raise ValueError(f"bind_target: the target's final norm weight must be [{H}], got "
                             f"{tuple(final_norm_weight.shape)}")
        self._embed_weight = embed_weight.detach()
        self._final_norm_weight = final_norm_weight.detach()
        self._final_norm_eps = float(final_norm_eps)

    def _bound(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._embed_weight is None or self._final_norm_weight is None:
            raise RuntimeError("DLiteDrafter: call bind_target(target_embed_weight, "
                               "target_final_norm_weight, eps) first (shared with the target)")
        if self._embed_weight.device != self.norm.weight.device:
            raise RuntimeError(f"the bound target embedding is on {self._embed_weight.device} but "
                               f"the drafter is on {self.norm.weight.device}: bind again after moving")
        return self._embed_weight, self._final_norm_weight

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._bound()[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    # ------------------------------------------------------------------ one round's inputs
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Features ``[b, L, H]`` (vLLM aux ids j+1, all pre-norm) -> context slots
        ``c_l = RMSNorm_ctx(f_l + E_depth[j_l])`` ``[b, L, H]``; the last feature (target layer
        N-1) first goes through the target's final norm."""
        L, H = self.config.num_feature_layers, self.config.hidden_size
        if features.dim() != 3 or features.shape[1:] != (L, H):
            raise ValueError(f"features must be [b, L={L}, H={H}] (layer-major, ascending id; "
                             f"reshape vLLM's [b, L*H] rows), got {tuple(features.shape)}")
        _, final_norm = self._bound()
        f = features.to(self.dtype)
        last = rms_norm(f[:, -1], final_norm.to(self.dtype), self._final_norm_eps)
        f = torch.cat([f[:, :-1], last[:, None]], dim=1)
        return self.context_norm(f + self.layer_depth_embedding(self.layer_ids))

    def query(self, group_ids: torch.Tensor) -> torch.Tensor:
        """Real tokens ``[b, g]`` -> query slots ``[E(x_{a-g+1}) .. E(x_a), E(m) x (B-1)]``
        ``[b, g+B-1, H]``."""
        b = group_ids.shape[0]
        masks = group_ids.new_full((b, self.config.num_draft_tokens), self.config.mask_token_id)
        return F.embedding(torch.cat([group_ids, masks], dim=1), self.embed_weight).to(self.dtype)

    def rope(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[L+Q, D]`` (activation dtype): L context rows at ``max(g-2, 0)``, then the
        Q = g+B-1 query rows at 0..Q-1. The same for every round: built once per (g, device,
        dtype) on the device (no host copy, so a CUDA graph can capture a round)."""
        key = (g, self.device, self.dtype)
        if key not in self._rope_cache:
            cfg = self.config
            Q = g + cfg.num_draft_tokens
            positions = torch.cat([torch.full((cfg.num_feature_layers,), max(g - 2, 0), device=self.device),
                                   torch.arange(Q, device=self.device)])
            self._rope_cache[key] = ops.rope_cos_sin(
                positions, cfg.head_dim, cfg.rope_theta, dtype=self.dtype, rope_scaling=cfg.rope_scaling,
                max_position_embeddings=cfg.max_position_embeddings)
        return self._rope_cache[key]

    # ------------------------------------------------------------------ backbone + head
    def backbone(self, features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Non-causal backbone: features ``[b, L, H]``, group_ids ``[b, g]`` -> mask-slot
        outputs ``d [b, K, H]`` (after the final norm; ``d[:, k-1]`` predicts ``x_{a+k}``)."""
        if group_ids.dim() != 2 or not 1 <= group_ids.shape[1] <= self.config.anchor_group_size:
            raise ValueError(f"group_ids must be [b, g] with 1 <= g <= G={self.config.anchor_group_size}, "
                             f"got {tuple(group_ids.shape)}")
        g = group_ids.shape[1]
        c = self.context(features)  # [b, L, H]
        x = self.query(group_ids)  # [b, Q, H]
        cos, sin = self.rope(g)
        for layer in self.layers:
            x = layer(x, c, cos, sin)
        return self.norm(x)[:, g:]

    def _prime_ids(self, group_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """``x_{a-1}`` when G > 1 (the head is primed with it), else None."""
        if self.config.anchor_group_size == 1:
            return None
        if group_ids.shape[1] < 2:
            raise ValueError("G > 1 primes the head with x_{a-1}: group_ids needs >= 2 tokens "
                             "(the anchor always follows at least one prompt token)")
        return group_ids[:, -2]

    @torch.no_grad()
    def draft(self, features: torch.Tensor, group_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None, k: Optional[int] = None) -> DraftOutput:
        """One round: backbone once, then ``k <= K`` head steps, one per drafted token (default K), greedy
        or sampled (:func:`vllm_dlite.ops.sampling.is_greedy`). ``group_ids [b, g]``, anchor last."""
        d = self.backbone(features, group_ids)
        ids, logits = ops.sequential_head(
            d, group_ids[:, -1], self._prime_ids(group_ids), *self.sequential_head.tensors(),
            temperature=temperature, generator=generator, k=k,
        )
        return DraftOutput(ids, logits)

    def forward_train(self, features: torch.Tensor, group_ids: torch.Tensor, labels: torch.Tensor,
                      return_readout: bool = False) -> torch.Tensor:
        """Teacher-forced training forward: features ``[b, L, H]`` at ``a-1``, group_ids
        ``[b, g]``, labels ``[b, K]`` = ``x_{a+1..a+K}`` (the head is fed ``x_a, labels[:, :-1]``)
        -> logits ``[b, K, V]`` fp32, or the head readouts ``[b, K, r]`` with ``return_readout``
        (project with ``sequential_head.output_proj`` in chunks)."""
        return self.head_teacher_forced(self.backbone(features, group_ids), group_ids, labels, return_readout)

    def head_teacher_forced(self, d: torch.Tensor, group_ids: torch.Tensor, labels: torch.Tensor,
                            return_readout: bool = False) -> torch.Tensor:
        """The sequential head over backbone outputs ``d [b, K, H]``, fed ``x_a, labels[:, :-1]``."""
        head = self.sequential_head
        return ops.sequential_head_teacher_forced(
            d, group_ids[:, -1], self._prime_ids(group_ids), labels, head.prev_token_embedding.weight,
            head.state_proj.weight, head.state_proj.bias, head.state_hidden_mlp.weight,
            head.state_hidden_mlp.bias, None if return_readout else head.output_proj.weight,
        )

    forward = forward_train


__all__ = [
    "DLiteDrafter",
    "DraftAttention",
    "DraftDecoderLayer",
    "DraftOutput",
    "INIT_STD",
    "RMSNorm",
    "SequentialHead",
    "SwiGLU",
    "activation",
    "rms_norm",
]
