"""DLite proposer for vLLM's Model Runner V1 (the runner vLLM uses on CPU).

:class:`DLiteProposer` subclasses vLLM's ``DFlashProposer`` (the parallel-drafting proposer) so
that every ``isinstance(drafter, DFlashProposer)`` branch of ``GPUModelRunner`` keeps working
(aux hidden states, padded drafter batch, next-token preparation, rejection bookkeeping); it
replaces what touches the draft model:

* ``load_model``: builds ``DFlashDLiteDraftModel`` through vLLM's loader, checks it created no
  attention layer (no draft KV cache), shares the target's token embedding and final norm.
* ``initialize_attn_backend``: there are no draft attention layers, but the runner only hands
  ``spec_decode_common_attn_metadata`` to a drafter whose ``kv_cache_gid`` matches a KV-cache
  group; with the base class's ``-1`` it would silently never draft. We set ``kv_cache_gid = 0``.
* ``propose``: per request, gather the L feature vectors of the row that predicted the anchor
  (``token_indices_to_sample``: the last accepted row after verification, or the last scheduled
  row of a prefill chunk when it is ``None``) from ``target_hidden_states [num_tokens, L*H]``;
  anchor = ``next_token_ids``; with G > 1 the G-1 tokens before the anchor
  (:func:`vllm_dlite.model.anchor_group`: this step's input ids, or the request's token history,
  ``input_batch.token_ids_cpu``, for positions scheduled earlier; fewer at sequence start); one
  backbone pass + k head steps (k = ``num_speculative_tokens``). Greedy
  drafts unless ``draft_sample_method="probabilistic"`` (with the standard rejection sampler) and the batch has
  sampled requests: then sampled rows draw from ``softmax(logits / T_request)`` and
  ``take_last_draft_probs`` returns those probabilities for lossless rejection sampling.

Mixed prefill/decode batches, chunked prefill, preemption and requests finishing mid-batch need no
state here (the drafter is history-free): each round reads only the current batch (and, with
G > 2, the requests' token history that vLLM keeps). Drafts of a
partial prefill chunk are computed from its last scheduled row and discarded by vLLM's scheduler
(``Scheduler.update_draft_token_ids`` ignores drafts of prefill chunks); a preempted request is
re-prefilled and drafted from its new last row.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dlite.model import anchor_group
from vllm_dlite.ops.sampling import draft_probs, draft_temperatures
from vllm_dlite.vllm.draft_model import checked_checkpoint


logger = init_logger("vllm.dlite.proposer_v1")  # under "vllm": vLLM's handlers


class DLiteProposer(DFlashProposer):
    """History-free DLite drafter behind vLLM's V1 parallel-drafting proposer interface."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # the base class does not keep it (token history, request states)
        self.dlite_config = checked_checkpoint(self.draft_model_config)[1]  # validated at config time
        self.kv_cache_gid = 0  # no draft KV; see module docstring
        self._draft_attn_layer_names = set()
        # The DFlash base allocates per-token draft input buffers we never use; keep them tiny.
        self.hidden_states = torch.empty(0, self.hidden_size, dtype=self.dtype, device=device)
        self.inputs_embeds = torch.empty(0, self.inputs_embeds_size, dtype=self.dtype, device=device)

    # ------------------------------------------------------------------ model / KV
    def load_model(self, target_model: torch.nn.Module) -> None:
        before = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase).keys())
        self.model = self._get_model()
        after = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase).keys())
        if after - before:
            raise RuntimeError(
                f"the DLite draft model created attention layers {sorted(after - before)}; it "
                "must not (it would allocate a draft KV cache)"
            )
        self._draft_attn_layer_names = set()
        self.model.bind_target_model(target_model)
        logger.info(
            "DLite drafter loaded from %s: K=%d, G=%d, %d target layers %s, no draft KV cache",
            self.model.checkpoint_dir,
            self.dlite_config.num_draft_tokens,
            self.dlite_config.anchor_group_size,
            self.dlite_config.num_feature_layers,
            self.dlite_config.target_layer_ids,
        )

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        self.kv_cache_gid = 0
        self.draft_attn_groups = []
        groups = kv_cache_config.kv_cache_groups
        self.block_size = groups[0].kv_cache_spec.block_size if groups else 16

    def validate_same_kv_cache_group(self, kv_cache_config) -> None:
        return  # no draft layers

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        self.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: Optional[dict[str, torch.Tensor]] = None,
    ) -> None:
        """Profiling / warm-up: one draft round for ``min(num_tokens, max_num_seqs)`` requests."""
        B = max(1, min(int(num_tokens), self.max_batch_size))
        cfg = self.dlite_config
        features = torch.zeros(
            B, cfg.num_feature_layers * cfg.hidden_size, dtype=self.dtype, device=self.device
        )
        group = torch.zeros(B, cfg.anchor_group_size, dtype=torch.long, device=self.device)
        self.model.propose_drafts(features, group)

    def _temperatures(self, sampling_metadata: Any) -> Optional[torch.Tensor]:
        """Per-request temperatures when drafts must be sampled, else None (greedy drafts)."""
        return draft_temperatures(self._enable_probabilistic_draft_probs and sampling_metadata is not None,
                                  getattr(sampling_metadata, "temperature", None),
                                  bool(getattr(sampling_metadata, "all_greedy", False)))

    @torch.inference_mode()
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: Optional[torch.Tensor],
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: Optional[torch.Tensor] = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        """``[B, k]`` drafts for the batch (``k = num_speculative_tokens``)."""
        self.num_speculative_tokens = k = num_speculative_tokens
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        if token_indices_to_sample is None:
            # prefill (or unpadded batch): the last scheduled row of each request
            token_indices_to_sample = common_attn_metadata.query_start_loc[1 : batch_size + 1] - 1
        rows = token_indices_to_sample[:batch_size].long()  # [B] the row that predicted the anchor
        anchors = next_token_ids[:batch_size].long()  # [B]
        temperatures = self._temperatures(sampling_metadata)
        history = self.runner.input_batch.token_ids_cpu  # [max_num_reqs, max_len], batch row order
        group_ids, group_lens = anchor_group(
            anchors, rows, target_token_ids, self.dlite_config.anchor_group_size,
            step_positions=target_positions, query_start=common_attn_metadata.query_start_loc[:batch_size],
            history=torch.from_numpy(history) if isinstance(history, np.ndarray) else history,
            history_rows=torch.arange(batch_size),
        )
        draft_ids, logits = self.model.propose_drafts(
            target_hidden_states[rows],  # [B, L*H]
            group_ids,
            group_lens,
            temperatures=temperatures,
            k=k,
            return_logits=temperatures is not None,
        )
        if logits is not None:
            self._last_draft_probs = draft_probs(logits, temperatures).contiguous()
        return draft_ids


__all__ = ["DLiteProposer"]
