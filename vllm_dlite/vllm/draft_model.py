"""The vLLM-facing DLite draft model: ``DFlashDLiteDraftModel``.

vLLM builds it through its model registry and loader (``get_model``) like any draft model; it is a
thin wrapper around :class:`vllm_dlite.model.DLiteDrafter`:

* **Loading** goes through the one loader, :func:`vllm_dlite.model.load_drafter`, in
  ``__init__`` (vLLM constructs the model on the target device and dtype). ``load_weights`` does
  not read vLLM's weight iterator again; it reports every parameter as loaded.
* **Embedding and lm_head are the target's** (tied or not): :meth:`bind_target_model`, called by
  the proposer after the target is loaded, hands the target's ``embed_tokens.weight`` and
  ``lm_head.weight`` to ``DLiteDrafter.bind_target`` (no copy). A checkpoint that carries its own
  ``embed_tokens``/``lm_head`` keeps them.
* **Tensor parallelism: every rank holds the whole drafter** (its own weights are replicated; they
  are small) **and a full copy of the shared embedding / lm_head**, all-gathered once from the
  target's vocabulary-parallel shards at load time and put back in token-id order with vLLM's
  ``get_sharded_to_full_mapping``. Each rank then drafts alone from the same all-reduced aux
  hidden states and the same anchors, so all ranks compute the same drafts with no collective
  inside the K head steps (the fused sequential-head op needs the whole vocabulary for its argmax).
  Cost: ``(1 - 1/TP)`` of each matrix extra per rank (Qwen3-8B, untied, bf16, TP=2: 0.62 GB per
  matrix, 1.25 GB per rank); the README's "Tensor parallelism" section has the time trade-off.
* **No vLLM ``Attention`` layers** are created, so vLLM allocates **no draft KV cache**: the
  drafter's attention runs over ``[L target features ; K block elements]`` built afresh every
  round (``vllm_dlite.ops.draft_attention``).
* :meth:`propose_drafts` is what the DLite proposer (V1) and speculator (V2) call: one backbone
  pass + K sequential-head steps for a batch of requests, greedy or sampled per request.

``forward``/``compute_logits``/``embed_input_ids`` exist because vLLM's model interface requires
them; ``forward`` returns the parallel backbone output and ``compute_logits`` its logits WITHOUT the
sequential head (use :meth:`propose_drafts` for drafting).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite.model import DLiteDrafter, load_drafter

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below are greedy


class DFlashDLiteDraftModel(nn.Module):
    """DLite drafter as a vLLM model (registered as architecture ``DFlashDLiteDraftModel``)."""

    # vLLM interface flags
    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm_dlite.vllm.plugin import resolve_checkpoint_dir

        spec = vllm_config.speculative_config
        if spec is None or spec.draft_model_config is None:
            raise ValueError(
                "DFlashDLiteDraftModel is a draft model: serve it as "
                "speculative_config={'method': 'dlite', 'model': <dir>}, not as the target"
            )
        draft_cfg = spec.draft_model_config
        self.config = draft_cfg.hf_config
        directory = resolve_checkpoint_dir(draft_cfg.model, getattr(draft_cfg, "revision", None))
        device = vllm_config.device_config.device
        self.drafter: DLiteDrafter = load_drafter(directory, device=device, dtype=draft_cfg.dtype)
        self.dlite_config = self.drafter.config
        self.checkpoint_dir = directory
        self.prefix = prefix
        self.has_own_embed_tokens = self.drafter.embed_tokens is not None
        self.has_own_lm_head = self.drafter.lm_head is not None

    # ------------------------------------------------------------------ sizes
    @property
    def block_size(self) -> int:
        return self.dlite_config.block_size

    @property
    def num_feature_layers(self) -> int:
        return self.dlite_config.num_feature_layers

    @property
    def target_hidden_size(self) -> int:
        return self.dlite_config.target_hidden_size

    @property
    def vocab_size(self) -> int:
        return self.dlite_config.target_vocab_size

    # ------------------------------------------------------------------ target sharing
    def bind_target_model(self, target_model: nn.Module) -> None:
        """Share the target's token embedding and lm_head (tied or not); no copies."""
        lm = target_model.get_language_model() if hasattr(target_model, "get_language_model") else target_model
        inner = getattr(lm, "model", lm)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            embed = getattr(inner, "embedding", None)
        lm_head = getattr(lm, "lm_head", None)
        embed_w = None if self.drafter.embed_tokens is not None else _full_weight(embed, "embed_tokens")
        if self.drafter.lm_head is not None:
            head_w = None
        elif lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is getattr(embed, "weight", 0):
            head_w = embed_w if embed_w is not None else _full_weight(lm_head, "lm_head")  # tied: gather once
        else:
            head_w = _full_weight(lm_head, "lm_head")
        for name, w in (("embed_tokens", embed_w), ("lm_head", head_w)):
            if w is not None and w.shape[0] < self.vocab_size:
                raise ValueError(
                    f"the target's {name} has {w.shape[0]} rows but the DLite drafter needs "
                    f"{self.vocab_size} (target_vocab_size): the drafter was trained for a target "
                    "with a larger vocabulary; use a drafter trained for this target"
                )
        self.drafter.bind_target(embed_w, head_w)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose_drafts(
        self,
        features: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperatures: Optional[torch.Tensor] = None,
        num_tokens: Optional[int] = None,
        return_logits: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One DLite round for ``B`` requests.

        Args:
            features: ``[B, L*Ht]`` (vLLM's concatenated aux hidden states, layer-major) or
                ``[B, L, Ht]``: the target's features at the row that predicted the anchor.
            anchor_ids: ``[B]`` the token the target just produced.
            temperatures: ``[B]`` per-request temperatures, or None for greedy everywhere;
                entries below ``GREEDY_EPS`` are greedy.
            num_tokens: keep the first ``num_tokens <= K`` drafts (default K).
            return_logits: also return the raw draft logits ``[B, k, V]`` fp32 (the draft
                distribution of a sampled row is ``softmax(logits / T)``).

        Returns ``(draft_ids [B, k] int64, logits or None)``.
        """
        B = anchor_ids.shape[0]
        L, Ht = self.num_feature_layers, self.target_hidden_size
        if features.dim() == 2:
            if features.shape[-1] != L * Ht:
                raise ValueError(
                    f"DLite expects {L} target layers x {Ht} = {L * Ht} features per row, got "
                    f"{features.shape[-1]}: the target's aux hidden states do not match the "
                    "checkpoint's eagle_aux_hidden_state_layer_ids"
                )
            features = features.reshape(B, L, Ht)
        anchor_ids = anchor_ids.long()
        k = self.block_size if num_tokens is None else int(num_tokens)
        if B == 0 or k == 0:
            empty = torch.empty(B, k, dtype=torch.long, device=anchor_ids.device)
            return empty, (None if not return_logits else features.new_zeros(B, k, self.vocab_size, dtype=torch.float32))

        groups: list[tuple[float, Optional[torch.Tensor]]]
        if temperatures is None:
            groups = [(0.0, None)]
        else:
            temps = temperatures[:B].float().tolist()
            values = sorted({0.0 if t < GREEDY_EPS else t for t in temps})
            if len(values) == 1:
                groups = [(values[0], None)]
            else:
                groups = []
                for v in values:
                    idx = [i for i, t in enumerate(temps) if (0.0 if t < GREEDY_EPS else t) == v]
                    groups.append((v, torch.tensor(idx, device=anchor_ids.device)))

        if len(groups) == 1:
            out = self.drafter.draft(features, anchor_ids, temperature=groups[0][0])
            ids, logits = out.token_ids, out.logits
        else:
            ids = torch.empty(B, self.block_size, dtype=torch.long, device=anchor_ids.device)
            logits = torch.empty(
                B, self.block_size, self.vocab_size, dtype=torch.float32, device=anchor_ids.device
            )
            for temp, idx in groups:
                out = self.drafter.draft(features[idx], anchor_ids[idx], temperature=temp)
                ids[idx] = out.token_ids
                logits[idx] = out.logits
        ids = ids[:, :k]
        return ids, (logits[:, :k] if return_logits else None)

    # ------------------------------------------------------------------ vLLM model interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.long(), self.drafter.embed_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """Parallel backbone: ``input_ids`` = anchors ``[B]``, ``hidden_states`` = features
        ``[B, L*Ht]`` -> ``[B*K, H]`` (``positions`` is ignored: DLite uses local positions)."""
        if hidden_states is None:
            raise ValueError("DFlashDLiteDraftModel.forward needs the target features (hidden_states)")
        B = input_ids.shape[0]
        features = hidden_states.reshape(B, self.num_feature_layers, self.target_hidden_size)
        return self.drafter.backbone(features, input_ids.long()).flatten(0, 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of backbone outputs WITHOUT the sequential head (not used for drafting)."""
        d = self.drafter
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.config.rms_norm_eps)
        x = d.norm.weight.float() * x
        return F.linear(x.to(d.lm_head_weight.dtype), d.lm_head_weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Weights were loaded by ``load_drafter`` in ``__init__`` (the one loader); vLLM's
        iterator is not consumed (it would read the file a second time)."""
        return {name for name, _ in self.named_parameters()}


def _full_weight(module: Optional[nn.Module], name: str) -> torch.Tensor:
    """The target's ``[V_padded, H]`` embedding / lm_head weight over the WHOLE vocabulary, rows in
    token-id order. Unsharded: the weight itself (no copy). Vocabulary-parallel (TP > 1): every
    rank all-gathers the shards once (a collective: all ranks load the drafter together)."""
    weight = _weight(module, name)
    tp_size = getattr(module, "tp_size", 1)
    if tp_size <= 1:
        return weight
    from vllm.distributed import get_tp_group

    group = getattr(module, "parallel_group", None) or get_tp_group()
    with torch.no_grad():
        gathered = group.all_gather(weight.detach().contiguous(), dim=0)  # rank-major shards
        order = module.get_sharded_to_full_mapping()  # position in `gathered` of each token id
        if order is not None:
            gathered = gathered[torch.tensor(order, device=gathered.device)]
    if gathered.shape[0] != module.num_embeddings_padded:
        raise RuntimeError(
            f"gathering the target's {name} over {tp_size} ranks gave {gathered.shape[0]} rows, "
            f"expected {module.num_embeddings_padded}"
        )
    return gathered


def _weight(module: Optional[nn.Module], name: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"cannot share the target's {name} with the DLite drafter (no plain weight tensor "
            f"found on {type(module).__name__ if module is not None else None}); quantized or "
            "unusual targets need a DLite checkpoint that carries its own embed_tokens/lm_head"
        )
    return weight


__all__ = ["GREEDY_EPS", "DFlashDLiteDraftModel"]
