"""The DLite drafter (paper Sec. 4): history-free parallel backbone + low-rank sequential head.

One drafting round for B requests (request b: anchor ``x_t`` = the token the target just produced,
``features[b, l]`` = the target's residual stream at position ``t-1`` after layer
``config.target_layer_ids[l]``, vLLM aux convention, pre-norm)::

    z_l   = proj(norm_l(features_l)) + e_depth[l]           # Eq. (2): one element per layer
    block = [E(x_t), E(M), ..., E(M)]                        # K elements, M = config.mask_token_id
    for each layer:                                          # Qwen3-style, NON-causal
        block += Attn(q = block, kv = [z_1..z_L ; block])    # z's are context only, never updated
        block += SwiGLU(block)
    h_0..h_{K-1} = block                                      # backbone(); h_i predicts x_{t+i+1}
    s_i  = tanh(W_state s_{i-1} + W_in E(x_{t+i}))           # sequential head, rank r
    logits_i = lm_head(norm(h_i + W_out s_i));  x_{t+i+1} = argmax / sample

Local positions restart every round: features at 0, anchor at 1, placeholder i at 1 + i (RoPE).

Contract:
* The drafter holds NO state between calls: a draft depends only on ``(features, anchor)`` of its
  own request (not on the batch, not on earlier calls).
* ``embed_tokens`` and ``lm_head`` are the target's: pass them with :meth:`bind_target` (kept as
  plain references: not parameters, not in ``state_dict``, not moved by ``.to()``; bind after the
  target is on its final device). A checkpoint may carry its own ``embed_tokens.weight`` /
  ``lm_head.weight``; then those are used (required when the draft width differs from the
  target's).
* Logits are fp32 over the target vocabulary ``config.target_vocab_size`` (a padded lm_head is
  sliced).
* Features may arrive in any float dtype; they are cast to the drafter's dtype.
* Attention and the head go through :mod:`vllm_dlite.ops` (PyTorch reference today).
* Checkpoint = directory with ``config.json`` (:func:`vllm_dlite.config.make_checkpoint_config`) and
  ``model.safetensors`` (the drafter's own weights only); :func:`load_drafter` is the one loader.

Parameter names (also the safetensors keys): ``feature_norms.{l}.weight``, ``depth_embedding``
``[L or 1, H]``, ``feature_proj.weight`` (only if the target width differs, or "feature" mode),
``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``head.{w_in,w_state,w_out}``,
optionally ``embed_tokens.weight`` and ``lm_head.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite import ops
from vllm_dlite.config import DLiteConfig, make_checkpoint_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INIT_STD = 0.02


class CheckpointError(ValueError):
    """A DLite checkpoint exists but is malformed (the message names the file)."""


class DraftOutput(NamedTuple):
    token_ids: torch.Tensor  # [B, K] int64: drafted x_{t+1..t+K}
    logits: torch.Tensor  # [B, K, V] fp32, raw (the draft distribution is softmax(logits / T))


# =========================================================================== building blocks
class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale by ``weight`` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DraftAttention(nn.Module):
    """Qwen3 attention (q/k-norm, GQA, no bias) whose queries come from the block only and whose
    keys/values are this layer's projections of ``[context ; block]``; RoPE is applied in the op."""

    def __init__(self, cfg: DLiteConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            D,
        )
        self.scale = D**-0.5
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def project_queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n, H] -> [B, n, Hq, D]`` (q-normed, pre-RoPE)."""
        return self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))

    def project_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, n, H] -> k, v [B, n, Hkv, D]`` (k-normed, pre-RoPE)."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k, v

    def forward(
        self, block: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """block ``[B, K, H]`` (normed), context ``[B, L, H]``, cos/sin ``[K+1, D]``
        -> ``[B, K, H]``."""
        q = self.project_queries(block)  # [B, K, Hq, D]
        k_block, v_block = self.project_keys_values(block)  # [B, K, Hkv, D]
        k_feat, v_feat = self.project_keys_values(context)  # [B, L, Hkv, D]
        out = ops.draft_attention(q, k_feat, v_feat, k_block, v_block, cos, sin, self.scale)
        return self.o_proj(out.flatten(-2))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer over the block; the context is read, never updated."""

    def __init__(self, cfg: DLiteConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, block: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        block = block + self.self_attn(self.input_layernorm(block), context, cos, sin)
        return block + self.mlp(self.post_attention_layernorm(block))


class SequentialHead(nn.Module):
    """Parameters of the low-rank head ``s_i = tanh(w_state s_{i-1} + w_in E(x))``,
    ``h~_i = h_i + w_out s_i`` (nn.Linear layouts). ``w_out`` starts at zero, so an untrained
    head equals the parallel backbone."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(rank, hidden_size))  # [r, H]
        self.w_state = nn.Parameter(torch.empty(rank, rank))  # [r, r]
        self.w_out = nn.Parameter(torch.zeros(hidden_size, rank))  # [H, r]


# =========================================================================== shared body
class DLiteBase(nn.Module):
    """What the drafter and the training teacher share: feature elements (Eq. 2), the block,
    the backbone layers, the final norm, the sequential head and the target's embeddings."""

    def __init__(
        self, config: DLiteConfig, *, own_embed_tokens: bool = False, own_lm_head: bool = False
    ):
        super().__init__()
        config.validate()
        self.config = config
        cfg = config
        H, Ht, L = cfg.hidden_size, cfg.target_hidden_size, cfg.num_feature_layers

        # --- Eq. (2): z_l = proj(norm_l(h_l)) + e_depth[l]
        self.feature_norms = (
            nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(L))
            if cfg.feature_norm
            else None
        )
        feature_in = Ht if cfg.feature_mode == "sequence" else L * Ht
        needs_proj = cfg.feature_mode == "feature" or Ht != H
        self.feature_proj = nn.Linear(feature_in, H, bias=False) if needs_proj else None
        self.depth_embedding = (
            nn.Parameter(torch.zeros(cfg.num_feature_elements, H)) if cfg.depth_embedding else None
        )

        # --- parallel backbone + final norm + sequential head
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.head = SequentialHead(H, cfg.head_rank)

        # --- token embedding / lm_head: the target's (bind_target) unless the checkpoint owns them
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H) if own_embed_tokens else None
        self.lm_head = nn.Linear(H, cfg.target_vocab_size, bias=False) if own_lm_head else None
        self._target_embed_weight: Optional[torch.Tensor] = None
        self._target_lm_head_weight: Optional[torch.Tensor] = None

        self.reset_parameters()

    # ------------------------------------------------------------------ init
    def reset_parameters(self) -> None:
        """HF-style init: N(0, 0.02) for matrices and embeddings, ones for norms, ``w_out = 0``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INIT_STD)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.depth_embedding is not None:
            nn.init.normal_(self.depth_embedding, std=INIT_STD)
        nn.init.normal_(self.head.w_in, std=INIT_STD)
        nn.init.normal_(self.head.w_state, std=INIT_STD)
        nn.init.zeros_(self.head.w_out)

    # ------------------------------------------------------------------ target weights
    def bind_target(
        self, embed_weight: Optional[torch.Tensor], lm_head_weight: Optional[torch.Tensor]
    ) -> None:
        """Share the target's token embedding ``[V', H]`` and lm_head ``[V', H]`` (V' >=
        ``target_vocab_size``: a padded vocabulary is fine). Stored as detached references, not
        copied and not saved. Either may be None when the checkpoint carries its own."""
        H, V = self.config.hidden_size, self.config.target_vocab_size
        for name, weight, owned in (
            ("embed_weight", embed_weight, self.embed_tokens is not None),
            ("lm_head_weight", lm_head_weight, self.lm_head is not None),
        ):
            if weight is None:
                if not owned:
                    raise ValueError(
                        f"bind_target: {name} is required (this drafter does not own one)"
                    )
                continue
            if weight.dim() != 2 or weight.shape[1] != H or weight.shape[0] < V:
                raise ValueError(
                    f"bind_target: {name} must be [>= {V}, {H}] (target vocab x draft width), got "
                    f"{tuple(weight.shape)}; if the draft width differs from the target's, the "
                    "checkpoint must carry its own embed_tokens/lm_head"
                )
        if embed_weight is not None:
            self._target_embed_weight = embed_weight.detach()
        if lm_head_weight is not None:
            self._target_lm_head_weight = lm_head_weight.detach()[:V]

    def _shared_weight(
        self, own: Optional[nn.Module], bound: Optional[torch.Tensor], name: str
    ) -> torch.Tensor:
        if own is not None:
            return own.weight
        if bound is None:
            raise RuntimeError(
                f"{type(self).__name__} has no {name}: call bind_target(target_embed_weight, "
                "target_lm_head_weight) first (embeddings are shared with the target)"
            )
        if bound.device != self.norm.weight.device:
            raise RuntimeError(
                f"the bound target {name} is on {bound.device} but the drafter is on "
                f"{self.norm.weight.device}: call bind_target again after moving the models"
            )
        return bound

    @property
    def embed_weight(self) -> torch.Tensor:
        """``[V', H]`` token embedding E (own or the target's)."""
        return self._shared_weight(self.embed_tokens, self._target_embed_weight, "embed_tokens")

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` vocabulary projection (own or the target's)."""
        return self._shared_weight(self.lm_head, self._target_lm_head_weight, "lm_head")

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    # ------------------------------------------------------------------ inputs of one round
    def embed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[B, L, Ht]`` -> context elements ``[B, L, H]`` (``[B, 1, H]`` in
        "feature" mode). ``features[:, l]`` is target layer ``target_layer_ids[l]``."""
        cfg = self.config
        L, Ht = cfg.num_feature_layers, cfg.target_hidden_size
        if features.dim() != 3 or features.shape[1:] != (L, Ht):
            raise ValueError(
                f"features must be [B, L={L}, Ht={Ht}] (layer-major, ascending layer id; reshape "
                f"vLLM's [B, L*Ht] rows with .view(B, L, Ht)), got {tuple(features.shape)}"
            )
        x = features.to(self.dtype)
        if self.feature_norms is not None:  # norm_l: one RMSNorm per target layer
            x = torch.stack([norm(x[:, i]) for i, norm in enumerate(self.feature_norms)], dim=1)
        if cfg.feature_mode == "feature":  # ablation: concatenate along features -> one element
            x = x.flatten(1).unsqueeze(1)  # [B, 1, L*Ht]
        if self.feature_proj is not None:
            x = self.feature_proj(x)  # [B, L or 1, H]
        if self.depth_embedding is not None:
            x = x + self.depth_embedding  # e_depth[l]
        return x

    def embed_block(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Anchors ``[B]`` -> block ``[E(x_t), E(M), ..., E(M)]`` ``[B, K, H]``."""
        if anchor_ids.dim() != 1:
            raise ValueError(f"anchor_ids must be [B], got {tuple(anchor_ids.shape)}")
        K = self.config.block_size
        block_ids = anchor_ids.new_full((anchor_ids.shape[0], K), self.config.mask_token_id)
        block_ids[:, 0] = anchor_ids
        return F.embedding(block_ids, self.embed_weight).to(self.dtype)

    def local_rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [K+1, D]`` fp32 for local positions 0 (features) .. K (last placeholder)."""
        cfg = self.config
        return ops.rope_cos_sin(cfg.block_size + 1, cfg.head_dim, cfg.rope_theta, device=device)

    def head_logits_teacher_forced(
        self,
        h: torch.Tensor,
        anchor_ids: torch.Tensor,
        target_block_ids: torch.Tensor,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Teacher-forced head on backbone output ``h [B, K, H]`` -> logits ``[B, K, V]`` fp32
        (or the normalised hidden ``[B, K, H]`` fp32 when ``return_hidden``)."""
        return ops.sequential_head_teacher_forced(
            h,
            anchor_ids,
            target_block_ids,
            self.embed_weight,
            self.head.w_in,
            self.head.w_state,
            self.head.w_out,
            self.norm.weight,
            None if return_hidden else self.lm_head_weight,
            self.config.rms_norm_eps,
        )


# =========================================================================== the drafter
class DLiteDrafter(DLiteBase):
    """History-free DLite drafter. See the module docstring for the contract."""

    @classmethod
    def from_config(
        cls, config: DLiteConfig, *, own_embeddings: Optional[bool] = None
    ) -> "DLiteDrafter":
        """Fresh, randomly initialised drafter. ``own_embeddings`` (default: only when the draft
        width differs from the target's) gives it its own embed_tokens and lm_head."""
        if own_embeddings is None:
            own_embeddings = config.hidden_size != config.target_hidden_size
        return cls(config, own_embed_tokens=own_embeddings, own_lm_head=own_embeddings)

    def backbone(self, features: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Parallel, non-causal backbone: ``features [B, L, Ht]``, ``anchor_ids [B]`` ->
        ``h [B, K, H]`` (before the final norm; offset i predicts ``x_{t+i+1}``)."""
        context = self.embed_features(features)  # z_1..z_L  [B, L, H]
        block = self.embed_block(anchor_ids)  # [x_t, M, ..., M]  [B, K, H]
        cos, sin = self.local_rope(block.device)  # positions 0..K
        for layer in self.layers:
            block = layer(block, context, cos, sin)  # context is read, never updated
        return block

    @torch.no_grad()
    def draft(
        self,
        features: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> DraftOutput:
        """One drafting round: backbone once, then K head steps (greedy or sampled)."""
        h = self.backbone(features, anchor_ids)  # [B, K, H]
        token_ids, logits = ops.sequential_head(
            h,
            anchor_ids,
            self.embed_weight,
            self.head.w_in,
            self.head.w_state,
            self.head.w_out,
            self.norm.weight,
            self.lm_head_weight,
            self.config.rms_norm_eps,
            temperature=temperature,
            generator=generator,
        )
        return DraftOutput(token_ids, logits)

    def forward_train(
        self,
        features: torch.Tensor,
        anchor_ids: torch.Tensor,
        target_block_ids: torch.Tensor,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Teacher-forced training forward.

        ``features [B, L, Ht]`` (at t-1), ``anchor_ids [B]`` (x_t), ``target_block_ids [B, K]``
        (labels ``x_{t+1..t+K}``; head step i>0 is fed ``target_block_ids[:, i-1]``) ->
        logits ``[B, K, V]`` fp32 (or normalised hidden ``[B, K, H]`` fp32 with
        ``return_hidden=True``, for a chunked lm_head + loss). Logits at offset i depend on
        ``target_block_ids[:, :i]`` only.
        """
        h = self.backbone(features, anchor_ids)
        return self.head_logits_teacher_forced(h, anchor_ids, target_block_ids, return_hidden)

    forward = forward_train

    # ------------------------------------------------------------------ checkpoint
    def save_pretrained(
        self, directory: Union[str, Path], target_hf_config: dict[str, Any]
    ) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (own weights only) into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        dtype_name = str(self.dtype).removeprefix("torch.")
        config = make_checkpoint_config(self.config, target_hf_config, torch_dtype=dtype_name)
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return directory


def read_checkpoint_config(path: Union[str, Path]) -> tuple[dict[str, Any], DLiteConfig]:
    """Check a checkpoint directory and return ``(config.json dict, DLiteConfig)``.

    Raises ``FileNotFoundError`` (directory, config.json or model.safetensors missing),
    ``NotADirectoryError``, or :class:`CheckpointError` (bad JSON, not a DLite checkpoint, invalid
    dlite_config), each naming the path.
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"DLite checkpoint directory not found: {directory}")
    if not directory.is_dir():
        raise NotADirectoryError(
            f"DLite checkpoint must be a directory holding {CONFIG_FILE} and {WEIGHTS_FILE}, "
            f"got a file: {directory}"
        )
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} is missing: a DLite checkpoint directory holds {CONFIG_FILE} and "
                f"{WEIGHTS_FILE} (written by DLiteDrafter.save_pretrained)"
            )
    try:
        cfg_dict = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(cfg_dict, dict) or "dlite_config" not in cfg_dict:
        archs = cfg_dict.get("architectures") if isinstance(cfg_dict, dict) else None
        raise CheckpointError(
            f"{config_file} is not a DLite checkpoint: it has no 'dlite_config' block "
            f"(architectures: {archs}); DLite checkpoints are written by "
            "DLiteDrafter.save_pretrained"
        )
    try:
        config = DLiteConfig.from_checkpoint_config(cfg_dict)
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: {exc}") from None
    return cfg_dict, config


_WEIGHT_DTYPES = ("F32", "F16", "BF16")


def check_weights_file(path: Union[str, Path]) -> DLiteConfig:
    """Check a checkpoint's ``model.safetensors`` against its ``config.json`` WITHOUT reading the
    tensor data (header only; cheap enough for config time): the file is complete (its size is the
    header's), every tensor the config implies is there with its shape, none is unexpected, all are
    floating point (f32/f16/bf16). Raises one :class:`CheckpointError` naming the file and every
    problem. Returns the checkpoint's :class:`DLiteConfig`."""
    import struct

    _, config = read_checkpoint_config(path)
    weights_file = Path(path) / WEIGHTS_FILE
    size = weights_file.stat().st_size
    try:
        with open(weights_file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{weights_file} cannot be read as safetensors ({exc}); re-export the drafter with "
            "DLiteDrafter.save_pretrained"
        ) from None
    header.pop("__metadata__", None)
    data_end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if size != 8 + header_len + data_end:
        raise CheckpointError(
            f"{weights_file} is truncated or padded: {size} bytes, its header describes "
            f"{8 + header_len + data_end}; copy or re-export the checkpoint"
        )
    with torch.device("meta"):  # shapes only
        model = DLiteDrafter(config, own_embed_tokens="embed_tokens.weight" in header,
                             own_lm_head="lm_head.weight" in header)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problems = []
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    for name in sorted(set(expected) & set(header)):
        shape, dtype = tuple(header[name]["shape"]), header[name]["dtype"]
        if shape != expected[name]:
            problems.append(f"tensor '{name}' has shape {shape}, config.json implies {expected[name]}")
        if dtype not in _WEIGHT_DTYPES:
            problems.append(f"tensor '{name}' has dtype {dtype}, expected one of {list(_WEIGHT_DTYPES)}")
    if problems:
        raise CheckpointError(
            f"{weights_file} does not match its {CONFIG_FILE}: " + "; ".join(problems)
            + "; copy the checkpoint again or re-export it with DLiteDrafter.save_pretrained"
        )
    return config


def load_drafter(
    path: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
) -> DLiteDrafter:
    """The one loader (training, tests, vLLM): checkpoint directory -> :class:`DLiteDrafter`.

    ``dtype=None`` keeps the stored dtype. The drafter owns ``embed_tokens``/``lm_head`` iff the
    file carries ``embed_tokens.weight``/``lm_head.weight``; otherwise call ``bind_target`` next.
    Errors name the file and, for tensors, every missing/unexpected/mis-shaped name.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = check_weights_file(path)  # names, shapes, dtypes, completeness: one clear error
    weights_file = Path(path) / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_file), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights_file} cannot be read as safetensors: {exc}") from None

    with torch.device("meta"):  # shapes only: every value comes from the file
        model = DLiteDrafter(
            config,
            own_embed_tokens="embed_tokens.weight" in tensors,
            own_lm_head="lm_head.weight" in tensors,
        )
    model.load_state_dict(tensors, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "DLiteBase",
    "check_weights_file",
    "DLiteDrafter",
    "DraftAttention",
    "DraftDecoderLayer",
    "DraftOutput",
    "RMSNorm",
    "SequentialHead",
    "SwiGLU",
    "load_drafter",
    "read_checkpoint_config",
]
