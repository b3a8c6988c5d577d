"""The vLLM-facing DLite draft model: ``DFlashDLiteDraftModel``.

vLLM builds it through its model registry and loader (``get_model``) like any draft model; it is a
thin wrapper around :class:`vllm_dlite.model.DLiteDrafter`:

* **Loading** goes through the one loader, :func:`vllm_dlite.model.load_drafter`, in ``__init__``
  (vLLM constructs the model on the target device and dtype), with the checkpoint's directory and
  config as the config step validated them (:func:`checked_checkpoint`:
  config.json is not parsed again). ``load_weights`` does not read
  vLLM's weight iterator again; it reports every parameter as loaded.
* **Shared with the target**: its token embedding and its final norm (dlite_v1 never uses the
  target's lm_head). :meth:`bind_target_model`, called by the proposer after the target is loaded,
  hands them to ``DLiteDrafter.bind_target`` (no copy).
* **Tensor parallelism: every rank holds the whole drafter** (replicated; it is small) **and a full
  copy of the target's embedding**, all-gathered once from the vocabulary-parallel shards at load
  time and put back in token-id order with vLLM's ``get_sharded_to_full_mapping``. Each rank then
  drafts alone from the same all-reduced aux hidden states and the same tokens, so all ranks
  compute the same drafts with no collective inside the head steps.
* **No vLLM ``Attention`` layers** are created, so vLLM allocates **no draft KV cache**.
* :meth:`propose_drafts` is what the V1 proposer and the V2 speculator call: one backbone pass +
  k head steps for a batch, greedy or sampled per request, rows grouped by their number of real
  tokens g (only differs at sequence start, when a+1 < G).

``forward`` (its signature: vLLM's model-interface check reads it) and ``compute_logits`` exist
because vLLM's model interface requires them, and raise: drafting goes through
:meth:`propose_drafts`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite.config import DLiteConfig
from vllm_dlite.model import DLiteDrafter, load_drafter, resolve_checkpoint_dir
from vllm_dlite.ops.sampling import greedy_rows_as

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers


# on the draft hf_config: {"directory", "model", "revision", "config"} (plain data: it pickles)
CHECKPOINT_ATTR = "dlite_checkpoint"


def checked_checkpoint(draft_model_config) -> tuple[Path, DLiteConfig]:
    """``(directory, DLiteConfig)`` that the config step validated and put on vLLM's draft
    ``ModelConfig`` (its ``hf_config`` travels to every worker): what the draft model and both
    proposers size themselves by, without reading config.json. A worker whose file system lacks
    that directory (another node, another Hugging Face cache) resolves the checkpoint as given."""
    carried = getattr(draft_model_config.hf_config, CHECKPOINT_ATTR, None)
    if not isinstance(carried, dict):
        raise RuntimeError(
            "the draft model config carries no validated DLite checkpoint: it was built without "
            "vllm_dlite's plugin (install vllm-dlite in every environment vLLM runs in, so that "
            "vLLM loads the 'vllm.general_plugins' entry point)")
    directory = Path(carried["directory"])
    if not directory.is_dir():
        directory = resolve_checkpoint_dir(carried["model"], carried.get("revision"))
    return directory, DLiteConfig(**carried["config"])


class DFlashDLiteDraftModel(nn.Module):
    """DLite drafter as a vLLM model (registered as architecture ``DFlashDLiteDraftModel``)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        spec = vllm_config.speculative_config
        if spec is None or spec.draft_model_config is None:
            raise ValueError(
                "DFlashDLiteDraftModel is a draft model: serve it as "
                "speculative_config={'method': 'dlite', 'model': <dir>}, not as the target"
            )
        draft_cfg = spec.draft_model_config
        self.config = draft_cfg.hf_config
        directory, self.dlite_config = checked_checkpoint(draft_cfg)  # validated at config time
        device = vllm_config.device_config.device
        self.drafter: DLiteDrafter = load_drafter(directory, device=device, dtype=draft_cfg.dtype,
                                                  config=self.dlite_config)
        self.checkpoint_dir = directory
        self.prefix = prefix

    # ------------------------------------------------------------------ target sharing
    def bind_target_model(self, target_model: nn.Module) -> None:
        """Share the target's token embedding (gathered under TP) and final norm; no copies."""
        lm = target_model.get_language_model() if hasattr(target_model, "get_language_model") else target_model
        inner = getattr(lm, "model", lm)
        embed = getattr(inner, "embed_tokens", None) or getattr(inner, "embedding", None)
        norm = getattr(inner, "norm", None)
        embed_w = _full_weight(embed, "embed_tokens")
        norm_w = _weight(norm, "final norm")
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise ValueError(f"cannot read the epsilon of the target's final norm ({type(norm).__name__})")
        if embed_w.shape[0] < self.dlite_config.vocab_size:
            raise ValueError(
                f"the target's embedding has {embed_w.shape[0]} rows but the DLite drafter needs "
                f"{self.dlite_config.vocab_size}: use a drafter trained for this target"
            )
        self.drafter.bind_target(embed_w, norm_w, float(eps))

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose_drafts(
        self,
        features: torch.Tensor,
        group_ids: torch.Tensor,
        group_lens: Optional[torch.Tensor] = None,
        temperatures: Optional[torch.Tensor] = None,
        k: Optional[int] = None,
        return_logits: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One DLite round for ``b`` requests.

        Args:
            features: ``[b, L*H]`` (vLLM's concatenated aux hidden states, layer-major) or
                ``[b, L, H]``: the target's features at the row before the anchor.
            group_ids: ``[b, G']`` the last real tokens of each request, anchor last
                (``G' <= G``; left-padded when ``group_lens`` is given).
            group_lens: ``[b]`` (CPU) real tokens per row, ``<= G'``, or None (all ``G'``).
            temperatures: ``[b]`` per-request temperatures or None (greedy everywhere); greedy
                entries (:func:`vllm_dlite.ops.sampling.is_greedy`) draft greedily.
            k: tokens drafted this round, ``k <= K`` (default K); no head step beyond k is run.
            return_logits: also return the raw draft logits ``[b, k, V]`` fp32.

        Returns ``(draft_ids [b, k] int64, logits or None)``.
        """
        cfg = self.dlite_config
        b = group_ids.shape[0]
        L, H = cfg.num_feature_layers, cfg.hidden_size
        if features.dim() == 2:
            if features.shape[-1] != L * H:
                raise ValueError(
                    f"DLite expects {L} target layers x {H} = {L * H} features per row, got "
                    f"{features.shape[-1]}: the target's aux hidden states do not match the "
                    f"checkpoint's layer ids (aux {cfg.aux_layer_ids})"
                )
            features = features.reshape(b, L, H)
        group_ids = group_ids.long()
        k = cfg.num_draft_tokens if k is None else int(k)
        if b == 0 or k == 0:
            ids = torch.empty(b, k, dtype=torch.long, device=group_ids.device)
            return ids, (features.new_zeros(b, k, cfg.vocab_size, dtype=torch.float32) if return_logits else None)

        # rows of one drafter call share g and temperature
        temps = None if temperatures is None else greedy_rows_as(temperatures[:b], 0.0).cpu()  # greedy: 0
        if group_lens is None and (temps is None or bool((temps == temps[0]).all())):
            out = self.drafter.draft(features, group_ids, temperature=0.0 if temps is None else float(temps[0]),
                                     k=k)
            return out.token_ids, (out.logits if return_logits else None)
        lens = [group_ids.shape[1]] * b if group_lens is None else group_lens.tolist()
        row_keys = list(zip(lens, [0.0] * b if temps is None else temps.tolist()))  # (g, T) per row
        ids = torch.empty(b, k, dtype=torch.long, device=group_ids.device)
        logits = torch.empty(b, k, cfg.vocab_size, dtype=torch.float32, device=group_ids.device) if return_logits else None
        for g, temp in sorted(set(row_keys)):
            rows = torch.tensor([i for i, key in enumerate(row_keys) if key == (g, temp)], device=group_ids.device)
            out = self.drafter.draft(features[rows], group_ids[rows, group_ids.shape[1] - g:],
                                     temperature=temp, k=k)
            ids[rows] = out.token_ids
            if logits is not None:
                logits[rows] = out.logits
        return ids, logits

    # ------------------------------------------------------------------ vLLM model interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.long(), self.drafter.embed_weight)

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            "DLite drafts a whole round at once (propose_drafts: backbone + sequential head), not "
            "through a per-token forward"
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "DLite drafts through its sequential head (propose_drafts); the backbone has no "
            "logits of its own"
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Weights were loaded by ``load_drafter`` in ``__init__`` (the one loader); vLLM's
        iterator is not consumed (it would read the files a second time)."""
        return {name for name, _ in self.named_parameters()}


def _full_weight(module: Optional[nn.Module], name: str) -> torch.Tensor:
    """The target's ``[V_padded, H]`` token embedding over the WHOLE vocabulary, rows in
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
            f"found on {type(module).__name__ if module is not None else None}): DLite shares the "
            "target's token embedding and final-norm weight as plain tensors; serve it with a target "
            "whose embedding and final norm are not quantized"
        )
    return weight


__all__ = ["CHECKPOINT_ATTR", "DFlashDLiteDraftModel", "checked_checkpoint"]
