"""``dlite-adaptive`` / ``dlite-hybrid`` on Model Runner V1: :class:`AdaptiveDLiteProposer`.

A :class:`~vllm_dlite.vllm.proposer_v1.DLiteProposer` whose rounds propose per-request drafts of
``0..k`` tokens, decided by an :class:`~vllm_dlite.vllm.adaptive.controller.AdaptiveController`:

* each round begins in :meth:`AdaptiveDLiteProposer.before_drafting`, which the runner hook
  (:func:`vllm_dlite.vllm.adaptive.hooks.hook_v1_rounds_without_drafts`) calls before vLLM prepares
  the drafter's inputs; a round in which nobody drafts ends there;
* :meth:`AdaptiveDLiteProposer.draft_round` returns a ``list[list[int]]`` (vLLM's runner hands a
  list to the scheduler as is; async scheduling, which needs a tensor, is refused at start-up),
  gathering the drafter's inputs only for the rows that draft; in hybrid mode the suffix tree
  (:class:`~vllm_dlite.vllm.adaptive.suffix.SuffixSource`) drafts too, from each request's context
  ``token_ids_cpu[:a] + [x_a]`` (the accepted drafts of this step are already in ``token_ids_cpu``:
  the runner writes scheduled drafts there before the forward).

Lossless: only the drafts' lengths and sources change; vLLM's rejection sampler verifies them as
always. With ``draft_sample_method: "probabilistic"`` the suffix rows carry one-hot draft
probabilities (exact for a deterministic proposal).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger

from vllm_dlite.ops.sampling import draft_probs
from vllm_dlite.vllm.adaptive.controller import AdaptiveController
from vllm_dlite.vllm.adaptive.options import check_runner, options_from_vllm_config
from vllm_dlite.vllm.adaptive.suffix import SuffixSource
from vllm_dlite.vllm.proposer_v1 import DLiteProposer

logger = init_logger("vllm.dlite.adaptive")  # under "vllm": vLLM's handlers


class AdaptiveDLiteProposer(DLiteProposer):
    """The DLite V1 proposer with per-request draft lengths (and, hybrid, a second source)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        options = options_from_vllm_config(vllm_config)
        if options is None:
            raise ValueError("AdaptiveDLiteProposer serves 'method': 'dlite-adaptive' / 'dlite-hybrid' "
                             "(VllmConfig.additional_config['dlite_drafting']); plain 'dlite' uses DLiteProposer")
        check_runner(options, "v1", bool(getattr(runner, "use_async_scheduling", False)),
                     vllm_config.parallel_config.tensor_parallel_size)
        self.controller = AdaptiveController(options, self.dlite_config.num_draft_tokens)
        self.suffix: Optional[SuffixSource] = None
        if options.mode == "hybrid":
            self.suffix = SuffixSource(options, vllm_config.model_config.max_model_len)
        self._round = None  # (started, req_ids, plan or None): the round before_drafting began
        logger.info("DLite: %s drafting (%s)", options.mode,
                    ", ".join(f"{k}={v}" for k, v in options.to_dict().items() if k != "mode"))

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
        """The round's start, before vLLM prepares the drafter's inputs (called by the runner hook).

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

    def draft_round(self, k, rows, anchors, target_token_ids, target_positions, target_hidden_states,
                    temperatures, common_attn_metadata) -> list[list[int]]:
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
            probs = draft_probs(logits, temps)  # the head's probability of each drafted token
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


__all__ = ["AdaptiveDLiteProposer"]
