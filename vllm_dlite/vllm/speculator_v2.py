"""DLite speculator for vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``, the GPU default).

:class:`DLiteSpeculator` subclasses ``DraftModelSpeculator`` and is returned by the wrapped
``init_speculator`` (see :mod:`vllm_dlite.vllm.plugin`) when the draft checkpoint is DLite; on
vLLM 0.34 vLLM's speculator registry builds it (:mod:`vllm_dlite.vllm.registry_v034`).

Per step (``propose``), for the ``num_reqs`` requests of the batch, without CPU-GPU syncs on the
greedy path with G <= 2:

* feature row of request i = ``query_start_loc[i+1] - 1 - num_rejected[i]`` (its last accepted
  token, or the last row of its prefill chunk): the row that predicted the anchor;
* features = the L aux hidden states at those rows, ``[B, L, H]``;
* anchor = ``last_sampled[idx_mapping[i]]`` when the request sampled a token this step, else
  ``next_prefill_tokens[idx_mapping[i]]`` (partial prefill chunk; vLLM discards those drafts);
* the anchor group (:func:`vllm_dlite.model.anchor_group`, shared with the V1 proposer): with
  G = 2, ``x_{a-1}`` = this step's input id at that row (always scheduled this step); with G > 2,
  ``x_{a-G+1..a-1}`` come from this step's input or, for positions scheduled earlier, the
  request's token history (the runner's ``req_states``, which ``init_speculator`` hands over);
  near the start of a sequence the group shrinks to the tokens there are (one host sync, so
  G > 2 drafts eagerly, without CUDA graphs);
  a vLLM that does not pass ``req_states`` gets a clear error at construction (serve such a
  checkpoint with Model Runner V1);
* one backbone pass + k sequential-head steps (k = ``num_speculative_tokens``) ->
  ``draft_tokens[:num_reqs]``.

No draft attention layers, so no draft KV cache and no draft attention metadata (``set_attn``
only keeps the runner's objects). ``draft_sample_method="probabilistic"`` samples sampled rows
from ``softmax(logits / T_request)`` and writes the pre-temperature logits into
``self.draft_logits`` at each request's row (what V2's rejection sampler reads; a tensor on vLLM
0.32-0.33, a ``DraftLogitsCache`` on 0.34: :func:`vllm_dlite.vllm.compat.write_draft_logits`); this
path groups requests by temperature (one host sync) and runs eagerly.

CUDA graphs: when the runner's cudagraph mode is not NONE, drafts are greedy and G <= 2,
``capture()`` records ONE graph per batch size (powers of two up to ``max_num_seqs``, plus
``max_num_seqs``) of the whole draft step over static buffers, into vLLM's global graph pool; a
batch replays the smallest captured size >= its size. The graphs live in a ``CudaGraphManager``
subclass so that vLLM's cudagraph memory profiling drops them like its own speculators' managers
(its constructor's decode-query keyword differs between releases:
:func:`vllm_dlite.vllm.compat.graph_manager_decode_query`).

Adaptive verification (``"enable_adaptive_verification": true``, vLLM's; it needs full CUDA
graphs, so a GPU): vLLM's online acceptance estimator reads the sequential head's logits at every
draft position (:meth:`DLiteSpeculator._estimate_acceptance`), eagerly and inside the graphs; vLLM's
runner then verifies only the draft slots worth their cost. ``docs/adaptive-verification.md``;
checked on CPU against vLLM's estimator, untested on a GPU.

Not supported (clear errors or warnings): tensor/data parallel drafting with a sharded vocab,
draft watermarking, multimodal draft inputs.

This module must import on CPU-only installs: vLLM's V2 modules are imported in a ``try`` and a
placeholder that raises on use is defined when they are unavailable. It was written against
vLLM 0.32's V2 code and exercised on CPU with a fake batch (tests); what differs on 0.33-0.34 goes
through the named adapters of :mod:`vllm_dlite.vllm.compat` (``ADAPTERS``, compat group
``"v2 runner"``). GPU graph capture is untested here.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from vllm_dlite.model import anchor_group
from vllm_dlite.ops.sampling import draft_temperatures
from vllm_dlite.vllm import compat

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers

try:  # vLLM Model Runner V2 (GPU); importable on CPU installs too, but keep a guard
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    _V2_IMPORT_ERROR: Optional[BaseException] = None
except Exception as exc:  # noqa: BLE001
    DraftModelSpeculator = object  # type: ignore[assignment,misc]
    CudaGraphManager = object  # type: ignore[assignment,misc]
    CUDAGraphMode = None  # type: ignore[assignment]
    _V2_IMPORT_ERROR = exc


def _capture_sizes(max_num_reqs: int) -> list[int]:
    sizes, n = [], 1
    while n < max_num_reqs:
        sizes.append(n)
        n *= 2
    sizes.append(max_num_reqs)
    return sizes


class _DLiteGraphs(CudaGraphManager):  # type: ignore[misc,valid-type]
    """Holder of the per-batch-size draft graphs (a CudaGraphManager so that vLLM's cudagraph
    memory profiling discards it after its throwaway capture)."""

    def __init__(self, vllm_config, device, cudagraph_mode, sizes: list[int]):
        super().__init__(vllm_config, device, cudagraph_mode, **compat.graph_manager_decode_query(
            CudaGraphManager, query_len=1, max_num_reqs=vllm_config.scheduler_config.max_num_seqs))
        self.sizes = sorted(sizes)
        self.draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def padded_size(self, num_reqs: int) -> Optional[int]:
        for size in self.sizes:
            if size >= num_reqs and size in self.draft_graphs:
                return size
        return None


class DLiteSpeculator(DraftModelSpeculator):  # type: ignore[misc,valid-type]
    """History-free DLite drafting for Model Runner V2 (no draft KV cache)."""

    def __init__(self, vllm_config, device: torch.device, req_states=None):
        if _V2_IMPORT_ERROR is not None:
            raise RuntimeError(
                f"vLLM Model Runner V2 is unavailable ({_V2_IMPORT_ERROR!r}); DLite falls back to "
                "Model Runner V1 when V2 is not used"
            )
        super().__init__(vllm_config, device)
        from vllm_dlite.vllm.draft_model import checked_checkpoint

        self.dlite_config = cfg = checked_checkpoint(self.draft_model_config)[1]  # validated at config time
        # G > 2 reads x_{a-G+1..a-1} from the runner's RequestState (its token history)
        self.req_states = req_states
        if cfg.anchor_group_size > 2 and req_states is None:
            raise ValueError(
                f"this DLite checkpoint has anchor_group_size={cfg.anchor_group_size}; Model Runner "
                "V2 serves G > 2 from the request's token history, which this vLLM does not hand to "
                "speculators: set VLLM_USE_V2_MODEL_RUNNER=0 to serve it with Model Runner V1"
            )
        # adaptive verification (vLLM's, from the config) stays on: propose() feeds vLLM's online
        # acceptance estimator the head's logits at every draft position (_estimate_acceptance)
        self.draft_positions = torch.arange(self.num_speculative_steps, dtype=torch.int32, device=device)
        if self.draft_watermarker is not None:
            logger.warning("DLite: draft watermarking is not supported; drafts are unwatermarked")
            self.draft_watermarker = None
        self.draft_attn_layer_names: set[str] = set()
        self.attn_groups: list = []
        # static buffers of the draft step (CUDA-graph inputs)
        self.features = torch.zeros(
            self.max_num_reqs,
            cfg.num_feature_layers,
            cfg.hidden_size,
            dtype=self.dtype,
            device=device,
        )
        self.group_ids = torch.zeros(
            self.max_num_reqs, cfg.anchor_group_size, dtype=torch.long, device=device
        )
        self.graphs: Optional[_DLiteGraphs] = None

    # ------------------------------------------------------------------ model / attention
    def load_draft_model(self, target_model, target_attn_layer_names: set[str]):
        from vllm.compilation.backends import set_model_tag
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.model_loader import get_model
        from vllm.model_executor.model_loader.utils import get_draft_load_config

        with set_model_tag("dlite_head"):
            model = get_model(
                vllm_config=self.vllm_config,
                model_config=self.draft_model_config,
                load_config=get_draft_load_config(self.vllm_config),
            )
        new = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)) - set(
            target_attn_layer_names
        )
        if new:
            raise RuntimeError(f"the DLite draft model created attention layers {sorted(new)}")
        model.bind_target_model(target_model)
        return model

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups):
        # no draft attention: keep the runner's objects, build no backend
        self.model_state = model_state
        self.kv_cache_config = kv_cache_config
        self.block_tables = block_tables
        self.target_input_buffers = target_input_buffers
        self.target_attn_groups = target_attn_groups
        self.attn_groups = []
        self.supports_decode_metadata_update = False

    # ------------------------------------------------------------------ CUDA graphs
    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        self.graphs = None
        use_graphs = (
            cudagraph_mode is not None
            and cudagraph_mode != CUDAGraphMode.NONE
            and torch.device(self.device).type == "cuda"
            # probabilistic drafting runs eagerly (by the config: 0.34 allocates draft_logits in load_model)
            and self.speculative_config.draft_sample_method != "probabilistic"
            and self.dlite_config.anchor_group_size <= 2  # G > 2 reads the token history: eager
        )
        if use_graphs:
            self.graphs = _DLiteGraphs(
                self.vllm_config, self.device, cudagraph_mode, _capture_sizes(self.max_num_reqs)
            )

    def _draft_static(self, n: int) -> None:
        k = self.num_speculative_steps
        ids, logits = self.model.propose_drafts(
            self.features[:n], self.group_ids[:n], k=k, return_logits=self.acceptance_estimator is not None
        )
        self.draft_tokens[:n].copy_(ids)
        self._estimate_acceptance(logits, n, k)

    def _estimate_acceptance(self, logits: Optional[torch.Tensor], n: int, k: int) -> None:
        """Adaptive verification: vLLM's online estimator turns the head's distribution at each
        draft position, ``logits [n, k, V]`` (raw; it applies each request's temperature), into
        ``draft_token_confidence_probs[:n, :k]``, the acceptance probabilities from which vLLM's
        runner picks the draft slots it verifies next step. Position j's distribution is
        conditioned on drafts 1..j-1 only, never on draft j (what the estimator needs to stay
        lossless). Positions past k get 0: they were not drafted."""
        if self.acceptance_estimator is None or logits is None:
            return
        for j in range(k):  # a 0-dim step: confidence row = batch row
            self._maybe_predict_acceptance(logits[:, j], self.idx_mapping[:n], self.draft_positions[j])
        if k < self.num_speculative_steps:
            self.draft_token_confidence_probs[:n, k:].zero_()

    def capture(self) -> None:
        if self.graphs is None:
            return
        from vllm.platforms import current_platform

        pool = current_platform.get_global_graph_pool()
        self.features.zero_()
        self.group_ids.zero_()
        self.idx_mapping.fill_(-1)  # no request: the estimator (adaptive verification) skips every row
        logger.info("DLite: capturing %d draft CUDA graphs", len(self.graphs.sizes))
        for n in sorted(self.graphs.sizes, reverse=True):  # largest first: pool reuse
            self._draft_static(n)  # warm-up (allocator, lazy init)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._draft_static(n)
            self.graphs.draft_graphs[n] = graph
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ drafting
    def gather_inputs(
        self,
        input_batch,
        aux_hidden_states: list[torch.Tensor],
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(features [B, L, H], group_ids [B, G] int64, group_lens [B] or None, req_state_idx [B])``.

        ``last_sampled`` is V2's ``[max_num_reqs, 1]`` (one sampled token per request state) and
        ``next_prefill_tokens`` its ``[num_prefill_lookahead, max_num_reqs]``; both are indexed by
        request state (``idx_mapping``), never broadcast against the batch."""
        n = input_batch.num_reqs
        cfg = self.dlite_config
        if not aux_hidden_states or len(aux_hidden_states) != cfg.num_feature_layers:
            raise RuntimeError(
                f"DLite needs {cfg.num_feature_layers} aux hidden states (layers "
                f"{cfg.target_layer_ids}), got {0 if not aux_hidden_states else len(aux_hidden_states)}"
            )
        qsl = input_batch.query_start_loc[1 : n + 1].long()
        rows = qsl - 1 - num_rejected[:n].long()  # [B] the row that predicted the anchor
        features = torch.stack([h[rows] for h in aux_hidden_states], dim=1)  # [B, L, H]
        idx = input_batch.idx_mapping[:n].long()  # [B] request state of each row
        sampled = last_sampled.reshape(last_sampled.shape[0], -1)[idx, -1]  # [B]
        prefill = next_prefill_tokens.reshape(-1, next_prefill_tokens.shape[-1])[0, idx]  # [B]
        anchors = torch.where(num_sampled[:n] > 0, sampled, prefill).long()  # [B]
        G = cfg.anchor_group_size
        if G > 2 and self.req_states is None:
            raise RuntimeError(
                "DLite with anchor_group_size > 2 on Model Runner V2 needs the runner's request "
                "states (init_speculator(..., req_states)); this vLLM did not pass them"
            )
        group_ids, group_lens = anchor_group(
            anchors, rows, input_batch.input_ids, G,
            step_positions=input_batch.positions if G > 2 else None, query_start=input_batch.query_start_loc[:n],
            history=None if G <= 2 else self.req_states.all_token_ids.gpu, history_rows=idx,
        )  # G > 2: one host sync, so it drafts eagerly
        return features, group_ids, group_lens, idx

    @torch.inference_mode()
    def propose(
        self,
        input_batch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: Optional[list[torch.Tensor]],
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state=None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs=None,
        is_profile: bool = False,
        num_speculative_tokens: Optional[int] = None,
    ) -> torch.Tensor:
        n = input_batch.num_reqs
        if n == 0:
            return self.draft_tokens[:0]
        # this step's draft length (V2 may schedule fewer than num_speculative_steps)
        k = self.num_speculative_steps if num_speculative_tokens is None else int(num_speculative_tokens)
        k = max(0, min(k, self.num_speculative_steps))
        if k == 0:
            # vLLM 0.34 asks for no drafts on steps whose drafts nobody would verify (skip_drafts:
            # e.g. a prompt's non-final prefill chunks). DFlash still writes its draft KV then;
            # DLite keeps no state, so there is nothing to do: no backbone pass.
            return self.draft_tokens[:n]
        features, group_ids, group_lens, idx = self.gather_inputs(
            input_batch, aux_hidden_states, num_sampled, num_rejected, last_sampled,
            next_prefill_tokens,
        )
        estimate = self.acceptance_estimator is not None
        if estimate:  # the estimator reads each row's request state and temperature from these buffers
            self._copy_request_inputs(n, input_batch.idx_mapping[:n], temperature, seeds, dummy_run)
        temperatures = draft_temperatures(self.draft_logits is not None and not dummy_run, temperature, rows=idx)
        if temperatures is not None:
            # probabilistic drafting (eager): sampled rows draw from softmax(logits / T)
            ids, logits = self.model.propose_drafts(
                features, group_ids, group_lens, temperatures=temperatures, k=k,
                return_logits=True,
            )
            compat.write_draft_logits(self.draft_logits, idx, logits)
            self.draft_tokens[:n, :k].copy_(ids)
            self._estimate_acceptance(logits, n, k)
            return self.draft_tokens[:n]

        padded = None
        # with adaptive verification dummy runs replay too: vLLM times them for its draft-cost curve
        if (self.graphs is not None and not is_profile and group_lens is None
                and (not dummy_run or estimate)
                and k == self.num_speculative_steps):
            padded = self.graphs.padded_size(n)
        if padded is not None:
            self.features[:n].copy_(features)
            self.group_ids[:n].copy_(group_ids)
            self.graphs.draft_graphs[padded].replay()
        else:
            ids, logits = self.model.propose_drafts(features, group_ids, group_lens, k=k, return_logits=estimate)
            self.draft_tokens[:n, :k].copy_(ids)
            self._estimate_acceptance(logits, n, k)
        return self.draft_tokens[:n]


__all__ = ["DLiteSpeculator"]
