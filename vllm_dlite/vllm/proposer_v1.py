"""DLite proposer for vLLM's Model Runner V1 (the runner vLLM uses on CPU).

:class:`DLiteProposer` subclasses vLLM's ``DFlashProposer`` (the parallel-drafting proposer) so
that every ``isinstance(drafter, DFlashProposer)`` branch of ``GPUModelRunner`` keeps working
(aux hidden states, padded drafter batch, next-token preparation, rejection bookkeeping); it
replaces what touches the draft model:

* ``load_model``: builds ``DFlashDLiteDraftModel`` through vLLM's loader, checks it created no
  attention layer (no draft KV cache), shares the target's embedding and lm_head.
* ``initialize_attn_backend``: there are no draft attention layers, but the runner only hands
  ``spec_decode_common_attn_metadata`` to a drafter whose ``kv_cache_gid`` matches a KV-cache
  group; with the base class's ``-1`` it would silently never draft. We set ``kv_cache_gid = 0``.
* ``propose``: per request, gather the L feature vectors of the row that predicted the anchor
  (``token_indices_to_sample``: the last accepted row after verification, or the last scheduled
  row of a prefill chunk when it is ``None``) from ``target_hidden_states [num_tokens, L*H]``;
  anchor = ``next_token_ids``; with G > 1 the G-1 tokens before the anchor (:meth:`group_tokens`:
  this step's input ids, or the request's token history for positions scheduled earlier; fewer
  at sequence start); one backbone pass + k head steps (k = ``num_speculative_tokens``). Greedy
  drafts unless
  ``draft_sample_method="probabilistic"`` (with the standard rejection sampler) and the batch has
  sampled requests: then sampled rows draw from ``softmax(logits / T_request)`` and
  ``take_last_draft_probs`` returns those probabilities for lossless rejection sampling.

``dlite-adaptive`` / ``dlite-hybrid`` (:mod:`vllm_dlite.vllm.adaptive`): each round begins in
:meth:`DLiteProposer.before_drafting`, which the plugin's runner hook calls before vLLM prepares the
drafter's inputs (a round in which nobody drafts ends there); the proposer returns a
``list[list[int]]`` of per-request drafts of 0..k tokens (vLLM's runner hands a list to the
scheduler as is; async scheduling, which needs a tensor, is refused at start-up), decided by an
:class:`~vllm_dlite.vllm.adaptive.AdaptiveController` from the measured cost model, the
request's running acceptance and the head's probabilities; in hybrid mode the suffix tree
(:class:`~vllm_dlite.vllm.adaptive.SuffixSource`) drafts too, from each request's context
``token_ids_cpu[:a] + [x_a]`` (the accepted drafts of this step are already in ``token_ids_cpu``:
the runner writes scheduled drafts there before the forward).

Mixed prefill/decode batches, chunked prefill, preemption and requests finishing mid-batch need no
state here (the drafter is history-free): each round reads only the current batch. Drafts of a
partial prefill chunk are computed from its last scheduled row and discarded by vLLM's scheduler
(``Scheduler.update_draft_token_ids`` ignores drafts of prefill chunks); a preempted request is
re-prefilled and drafted from its new last row.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dlite.config import GREEDY_EPS
from vllm_dlite.vllm.adaptive import AdaptiveController, SuffixSource, check_runner, options_from_vllm_config


logger = init_logger("vllm.dlite.proposer_v1")  # under "vllm": vLLM's handlers


class DLiteProposer(DFlashProposer):
    """History-free DLite drafter behind vLLM's V1 parallel-drafting proposer interface."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # the base class does not keep it (token history, request states)
        from vllm_dlite.vllm.plugin import checkpoint_config

        self.dlite_config = checkpoint_config(self.draft_model_config)
        self.kv_cache_gid = 0  # no draft KV; see module docstring
        self._draft_attn_layer_names = set()
        # The DFlash base allocates per-token draft input buffers we never use; keep them tiny.
        self.hidden_states = torch.empty(0, self.hidden_size, dtype=self.dtype, device=device)
        self.inputs_embeds = torch.empty(0, self.inputs_embeds_size, dtype=self.dtype, device=device)
        # dlite-adaptive / dlite-hybrid (None: plain dlite, fixed k)
        options = options_from_vllm_config(vllm_config)
        check_runner(options, "v1", bool(getattr(runner, "use_async_scheduling", False)),
                     vllm_config.parallel_config.tensor_parallel_size)
        self.controller: Optional[AdaptiveController] = None
        self.suffix: Optional[SuffixSource] = None
        self._round = None  # (started, req_ids, plan or None): the round before_drafting began
        if options is not None:
            self.controller = AdaptiveController(options, self.dlite_config.num_draft_tokens)
            if options.mode == "hybrid":
                self.suffix = SuffixSource(options, vllm_config.model_config.max_model_len)
            logger.info("DLite: %s drafting (%s)", options.mode,
                        ", ".join(f"{k}={v}" for k, v in options.to_dict().items() if k != "mode"))

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
        if not self._enable_probabilistic_draft_probs or sampling_metadata is None:
            return None
        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            return None
        return sampling_metadata.temperature

    def group_tokens(
        self,
        anchors: torch.Tensor,
        rows: torch.Tensor,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        common_attn_metadata,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(group_ids [B, G], group_lens [B] or None)``: the anchor and the G-1 tokens before it.

        Row ``rows[i]`` holds position ``a-1`` and input token ``x_{a-1}``; ``x_{a-j}`` is this
        step's input at row ``rows[i]-(j-1)`` while that row belongs to request i, else the
        request's token history (``input_batch.token_ids_cpu``: positions scheduled in earlier
        steps). At sequence start g = min(G, a+1) (lens returned; unused slots hold 0)."""
        G = self.dlite_config.anchor_group_size
        if G == 1:
            return anchors[:, None], None
        B = anchors.shape[0]
        group = torch.zeros(B, G, dtype=torch.long, device=anchors.device)
        group[:, -1] = anchors
        group[:, -2] = target_token_ids[rows].long()  # x_{a-1}: always this step's input
        if G == 2:
            return group, None
        rows_c = rows.cpu()
        pos_c = target_positions[rows].long().cpu()  # a-1
        start_c = common_attn_metadata.query_start_loc_cpu[:B].long()
        tokens_c = target_token_ids.cpu()
        history = self.runner.input_batch.token_ids_cpu
        out = group.cpu()
        lens = torch.clamp(pos_c + 2, max=G)  # g = min(G, a+1)
        for i in range(B):
            for j in range(2, int(lens[i])):  # x_{a-j}
                row = int(rows_c[i]) - (j - 1)
                out[i, G - 1 - j] = (tokens_c[row] if row >= int(start_c[i])
                                     else int(history[i, int(pos_c[i]) + 1 - j]))
        return out.to(anchors.device), (None if bool((lens == G).all()) else lens)

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
    ) -> torch.Tensor | list[list[int]]:
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        if token_indices_to_sample is None:
            # prefill (or unpadded batch): the last scheduled row of each request
            token_indices_to_sample = common_attn_metadata.query_start_loc[1 : batch_size + 1] - 1
        rows = token_indices_to_sample[:batch_size].long()
        anchors = next_token_ids[:batch_size].long()
        temperatures = self._temperatures(sampling_metadata)
        if self.controller is not None:
            return self._propose_adaptive(
                num_speculative_tokens, rows, anchors, target_token_ids, target_hidden_states,
                temperatures, target_positions, common_attn_metadata,
            )
        features = target_hidden_states[rows]  # [B, L*H]
        group_ids, group_lens = self.group_tokens(
            anchors, rows, target_token_ids, target_positions, common_attn_metadata
        )
        draft_ids, logits = self.model.propose_drafts(
            features,
            group_ids,
            group_lens,
            temperatures=temperatures,
            k=num_speculative_tokens,
            return_logits=temperatures is not None,
        )
        if logits is not None:
            # draft distribution of each row: softmax(logits / T); greedy rows use T = 1
            # (vLLM ignores their probabilities, as in compute_probs_and_sample_next_token)
            t = temperatures[:batch_size].float().to(logits.device)
            t = torch.where(t < GREEDY_EPS, torch.ones_like(t), t)
            self._last_draft_probs = torch.softmax(logits / t.view(-1, 1, 1), dim=-1).contiguous()
        return draft_ids

    # ------------------------------------------------------------------ adaptive / hybrid
    def _suffix_drafts(self, k: int, req_ids: list[str], rows: torch.Tensor, anchors: torch.Tensor,
                       target_positions: torch.Tensor) -> list:
        """The suffix tree's draft per request, on its context ``x_0 .. x_a`` (module docstring)."""
        batch = self.runner.input_batch
        history = batch.token_ids_cpu
        a = (target_positions[rows].long() + 1).cpu().numpy().clip(0, history.shape[1] - 1)
        anchors_c = anchors.cpu().numpy()
        self.suffix.retire(batch.req_id_to_index.keys())  # as vLLM's suffix method: requests gone from the batch
        out = []
        for i, req_id in enumerate(req_ids):
            context = np.append(history[i, : a[i]], anchors_c[i]).astype(np.int32)
            out.append(self.suffix.draft(req_id, context, int(batch.num_prompt_tokens[i]), k))
        return out

    def before_drafting(self, scheduler_output, sampled_token_ids: torch.Tensor, spec_decode_metadata,
                        common_attn_metadata) -> Optional[list[list[int]]]:
        """dlite-adaptive / dlite-hybrid: the round's start, before vLLM prepares the drafter's inputs
        (called by the runner hook, :func:`vllm_dlite.vllm.plugin._hook_v1_rounds_without_drafts`).

        The controller learns from the verify step that just ran (per request: drafts verified, from
        ``spec_decode_metadata``; rejected, from ``sampled_token_ids [B, max_spec_len + 1]``, which
        holds the accepted drafts and one more token, then -1) and, in adaptive mode, plans the
        round. Returns the round's drafts when nobody drafts (all empty: the round ends here, and
        costs no drafter and none of vLLM's preparation for it), else None (vLLM prepares, then
        :meth:`propose`). Hybrid rounds always go on: the suffix drafts need vLLM's next tokens."""
        started = time.perf_counter()
        ctl = self.controller
        batch = self.runner.input_batch
        B = batch.num_reqs
        req_ids = list(batch.req_ids[:B])
        qsl = common_attn_metadata.query_start_loc_cpu[: B + 1].tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(B)]
        scheduled, rejected = [0] * B, None
        if spec_decode_metadata is not None:
            scheduled, rejected = list(spec_decode_metadata.num_draft_tokens[:B]), [0] * B
            if any(scheduled):
                valid = (sampled_token_ids[:B] != -1).sum(dim=1).tolist()  # accepted drafts + 1
                rejected = [d + 1 - v if d > 0 else 0 for d, v in zip(scheduled, valid)]
        ctl.begin_round(req_ids, scheduled, query_lens, rejected, live_req_ids=self.runner.requests,
                        now=started)
        plan = None
        if self.suffix is None:
            plan = ctl.plan(req_ids, scheduler_output.num_spec_tokens_to_schedule)
            if not plan.dlite_rows:
                ctl.end_round(req_ids, [None] * B, [0] * B, plan.phase, 0, None)
                return [[] for _ in range(B)]
        self._round = (started, req_ids, plan)
        return None

    def _propose_adaptive(self, k, rows, anchors, target_token_ids, target_hidden_states, temperatures,
                          target_positions, common_attn_metadata) -> list[list[int]]:
        """Per-request drafts of 0..k tokens, for a round that :meth:`before_drafting` began. The
        drafter's inputs (features, anchor groups) are gathered only for the rows that draft."""
        if self._round is None:
            raise RuntimeError("DLite adaptive drafting: propose() was called without before_drafting(), so "
                               "the Model Runner V1 hook of vllm_dlite.vllm.plugin is not installed: install "
                               "vllm-dlite in the engine's environment (its vllm.general_plugins entry point "
                               "registers it), or call vllm_dlite.vllm.plugin.register() before building the engine")
        (started, req_ids, plan), self._round = self._round, None
        ctl = self.controller
        B = rows.shape[0]
        if plan is None:  # hybrid: the suffix tree drafts first, the plan weighs its drafts
            plan = ctl.plan(req_ids, k, self._suffix_drafts(k, req_ids, rows, anchors, target_positions))
        confidence: dict[int, list[float]] = {}
        dlite_ids: dict[int, list[int]] = {}
        probs = None
        if plan.dlite_rows:
            features = target_hidden_states[rows]  # [B, L*H]
            group_ids, group_lens = self.group_tokens(
                anchors, rows, target_token_ids, target_positions, common_attn_metadata
            )
            sel_c = torch.tensor(plan.dlite_rows, dtype=torch.long)
            sel = sel_c.to(features.device)
            temps = None if temperatures is None else temperatures[:B][sel]
            ids, logits = self.model.propose_drafts(
                features[sel], group_ids[sel], None if group_lens is None else group_lens[sel_c],
                temperatures=temps, k=k, return_logits=True,
            )
            # the head's probability of each drafted token: softmax(logits / T) (greedy rows: T = 1)
            t = torch.ones(len(plan.dlite_rows), device=logits.device) if temps is None else temps.float().to(logits.device)
            t = torch.where(t < GREEDY_EPS, torch.ones_like(t), t)
            probs = torch.softmax(logits / t.view(-1, 1, 1), dim=-1)
            conf = probs.gather(-1, ids[..., None].to(probs.device)).squeeze(-1).cpu().tolist()
            for pos, row in enumerate(plan.dlite_rows):
                confidence[row] = conf[pos]
                dlite_ids[row] = ids[pos].tolist()
        lengths, sources = ctl.select(plan, req_ids, k, confidence)

        drafts = [list(plan.suffix[i].tokens[: lengths[i]]) if sources[i] == "suffix"
                  else dlite_ids[i][: lengths[i]] if sources[i] == "dlite" else [] for i in range(B)]
        if temperatures is not None and any(drafts):
            # vLLM reads draft probabilities [:len(draft)] per request; suffix drafts are one-hot
            V = self.dlite_config.vocab_size
            full = torch.zeros(B, k, V, dtype=torch.float32, device=anchors.device)
            if probs is not None:
                full[torch.tensor(plan.dlite_rows, device=anchors.device)] = probs.to(full.device)
            for i, tokens in enumerate(drafts):
                if sources[i] == "suffix" and tokens:
                    full[i, : len(tokens)] = 0.0
                    full[i, torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            self._last_draft_probs = full
        ctl.end_round(req_ids, sources, lengths, plan.phase, len(plan.dlite_rows),
                      time.perf_counter() - started if plan.dlite_rows else None)
        return drafts


__all__ = ["DLiteProposer"]
