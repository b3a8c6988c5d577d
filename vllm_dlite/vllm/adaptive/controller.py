"""The round-by-round policy of ``"dlite-adaptive"`` / ``"dlite-hybrid"``:
:class:`AdaptiveController`, on plain Python inputs (no vLLM; the proposer,
:class:`~vllm_dlite.vllm.adaptive.proposer.AdaptiveDLiteProposer`, feeds it).

Per round the proposer calls :meth:`~AdaptiveController.begin_round` (learn from the verify step
that just ran), :meth:`~AdaptiveController.plan` (which rows DLite drafts, before it runs),
:meth:`~AdaptiveController.select` (tokens to propose and their source, per row, after drafting) and
:meth:`~AdaptiveController.end_round`.

Cost model (measured online, no start-up calibration)
-----------------------------------------------------
One speculative cycle is a target step that verifies ``N`` tokens for ``B`` requests plus a draft
round. :class:`~vllm_dlite.vllm.adaptive.cost.CostModel` measures

* ``step(B, N, A) = level + c_req * B + c_tok * (N - B) + c_acc * A``: the wall time from the end
  of one round to the start of the next (scheduling, input preparation, the target forward,
  rejection sampling, output processing), from steps in which every request was decoding
  (``N - B`` = drafts verified, ``A`` = drafts accepted: each is one more token to emit, a cost
  every method pays per output token, which would otherwise be charged to the verified drafts).
  The level drifts (the base step grows with the context), so the slopes are fitted on
  differences of consecutive steps, where it cancels, and the level follows the latest steps;
* ``draft(B) = d0 + d1 * B``: the wall time of a round that drafts, from the round's start
  (:meth:`~vllm_dlite.vllm.adaptive.proposer.AdaptiveDLiteProposer.before_drafting`, before vLLM
  prepares the drafter's inputs) to the end of ``propose``: vLLM's preparation is part of the
  drafting cost.

It is identified by its own traffic: the first ``explore_rounds`` rounds alternate "propose
nothing" and "propose whole drafts" (for ``explore_share`` of the batch, at least one request, in
turn), and afterwards a round does the opposite of the current decision after ``probe_every``
rounds (a probe, so that neither the cost model nor the acceptance means go stale); the interval
doubles while probes confirm the decision (up to 16x) and resets when the decision flips.
``cost_model`` in the options replaces the fit by fixed numbers (tests, experiments).

Decision
--------
With ``p[i][j]`` the probability that request ``i`` accepts its first ``j+1`` drafts (before
drafting: the product of its running conditional acceptance per position; after: the product of the
calibrated head probabilities), the throughput of a round that verifies the set ``S`` of draft
tokens is ``(B + sum_S p) / (step(B, B) + c_tok |S| + c_acc sum_S p + draft(B))``; tokens are added
in decreasing ``p`` (prefixes only; for suffix drafts the tree's own cumulative probabilities) while
they raise it. Explore and probe-on rounds propose whole drafts, which is where the acceptance of
the head's unsure tokens is measured. Before drafting, from the running acceptance alone, the
drafter runs only when the best rate beats no speculation, ``B / step(B, B)``, by ``min_gain``;
otherwise every request proposes 0 tokens (or its suffix draft, which costs no drafter). After
drafting the draft time is spent either way, so the lengths then maximise the round's rate with it
included. A request that proposes nothing lets its own evidence fade
(:meth:`~vllm_dlite.vllm.adaptive.cost.AcceptanceStats.relax`), so it is tried again once the
population's acceptance says so.

Hybrid: a request proposes the suffix tree's draft when its score (the tree's estimate of accepted
drafts) beats DLite's own (the sum of the cumulative head probabilities), else DLite's
(:func:`~vllm_dlite.vllm.adaptive.cost.choose_source`). Before drafting, a request whose tree score
already beats ``suffix_skip_factor`` x DLite's expected accepted drafts from its running acceptance
takes the tree's draft without DLite drafting for it; when every request does, the drafter does not
run. Per-request counters record which source proposed every accepted token (:meth:`stats`, one
log line per finished request at DEBUG, a summary at INFO every ``log_every`` finished requests).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from vllm_dlite.vllm.adaptive.cost import (
    SOURCES,
    AcceptanceStats,
    CostModel,
    ConfidenceCalibration,
    choose_lengths,
    choose_source,
    expected_from_confidence,
    tree_before_drafting,
)
from vllm_dlite.vllm.adaptive.options import AdaptiveOptions
from vllm_dlite.vllm.adaptive.suffix import Match

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers


@dataclass
class SourceCounters:
    rounds: int = 0  # verifications that carried a draft of this source
    proposed: int = 0
    accepted: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted


@dataclass
class RequestCounters:
    sources: dict = field(default_factory=lambda: {s: SourceCounters() for s in SOURCES})
    rounds_without_draft: int = 0

    def as_dict(self) -> dict:
        return {s: vars(c).copy() for s, c in self.sources.items()} | {"rounds_without_draft": self.rounds_without_draft}


@dataclass
class Plan:
    """What a round does before DLite runs: the rows DLite drafts, the suffix drafts on offer."""
    dlite_rows: list[int]
    suffix: dict  # row -> Match (hybrid; rows with a match)
    phase: str  # "decide" | "explore-off" | "explore-on" | "probe-off" | "probe-on" | "fixed"


class AdaptiveController:
    """Everything the proposer decides per round, on plain Python inputs (unit-testable)."""

    def __init__(self, options: AdaptiveOptions, num_draft_tokens: int, clock=time.perf_counter):
        self.options, self.num_draft_tokens, self.clock = options, num_draft_tokens, clock
        self.cost = CostModel(options.cost_model, options.window, options.cost_decay)
        self.acceptance = AcceptanceStats(num_draft_tokens, options.prior_acceptance, options.prior_strength,
                                          options.request_decay, options.global_decay)
        self.round = 0
        self.speculating = True  # the last decision
        self._last_probe = 0
        self._explored = 0  # rows drafted by explore-on / probe-on rounds (whose turn is next)
        self._probe_interval = options.probe_every
        self._last_end: Optional[float] = None
        self._observed_round = -2  # the last round whose verify step the cost model saw
        self._pending: dict[str, tuple[str, int, list]] = {}  # req_id -> (source, proposed, head probs)
        self.calibration = ConfidenceCalibration(options.calibration_bins, options.prior_strength,
                                                 options.global_decay)
        self._confidence: dict[int, list] = {}  # row -> head probabilities of this round's DLite draft
        self.requests: dict[str, RequestCounters] = {}
        self.finished: dict[str, dict] = {}  # req_id -> counters (bounded)
        self.totals = {s: SourceCounters() for s in SOURCES}
        self.rounds_by_phase: dict[str, int] = {}
        self.num_finished = 0
        self._last_batch = 1

    @property
    def adaptive_length(self) -> bool:
        return self.options.mode == "adaptive" or self.options.adaptive_length

    # ---------------------------------------------------------------- after a verify step
    def begin_round(self, req_ids: Sequence[str], scheduled_drafts: Sequence[int],
                    query_lens: Sequence[int], num_rejected: Optional[Sequence[int]],
                    live_req_ids=None, now: Optional[float] = None) -> None:
        """Learn from the verify step that just ran: per request, ``scheduled_drafts[i]`` of its
        drafts were verified and ``num_rejected[i]`` rejected (None: no request had drafts); the
        step's wall time goes to the cost model when every request was decoding."""
        now = self.clock() if now is None else now
        self._last_batch = max(1, len(req_ids))
        decode_only = all(q == 1 + d for q, d in zip(query_lens, scheduled_drafts)) and len(query_lens) > 0
        if self._last_end is not None and decode_only:
            seconds = now - self._last_end
            typical = self.cost.typical_step_seconds()
            if typical is None or seconds < 8 * typical:  # not an idle gap between requests
                accepted = 0 if num_rejected is None else sum(
                    max(0, int(d) - int(r)) for d, r in zip(scheduled_drafts, num_rejected) if d > 0)
                self.cost.observe_step(len(query_lens), int(sum(query_lens)), seconds, accepted,
                                       consecutive=self._observed_round == self.round - 1)
                self._observed_round = self.round
        for i, req_id in enumerate(req_ids):
            pending = self._pending.pop(req_id, None)
            counters = self.requests.setdefault(req_id, RequestCounters())
            k = int(scheduled_drafts[i])
            if k <= 0 or num_rejected is None or pending is None:
                if pending is not None and query_lens[i] == 1:
                    counters.rounds_without_draft += 1
                    self.acceptance.relax(req_id)
                continue
            source = pending[0]
            if source not in SOURCES:
                continue
            accepted = max(0, k - int(num_rejected[i]))
            if source == "dlite":  # what the decisions read (suffix drafts carry their own probabilities)
                self.acceptance.observe(req_id, source, k, accepted)
                if pending[2]:
                    self.calibration.observe(pending[2][:k], accepted)
            counters.sources[source].add(k, accepted)
            self.totals[source].add(k, accepted)
        if live_req_ids is not None:
            self.retire([r for r in self.requests if r not in live_req_ids])

    # ---------------------------------------------------------------- before drafting
    def _phase(self) -> str:
        o = self.options
        if o.cost_model is None and self.round < o.explore_rounds:
            return "explore-on" if self.round % 2 else "explore-off"
        if not self.cost.ready and self.round < 4 * max(o.explore_rounds, 1):
            return "explore-on"
        if o.probe_every and self.round - self._last_probe >= self._probe_interval:
            # a probe that confirms the decision doubles the interval (up to 16x probe_every);
            # a decision that flips resets it (see select)
            self._last_probe = self.round
            self._probe_interval = min(2 * self._probe_interval, 16 * o.probe_every)
            return "probe-on" if not self.speculating else "probe-off"
        return "decide"

    def plan(self, req_ids: Sequence[str], k: int, suffix: Optional[Sequence[Optional[Match]]] = None) -> Plan:
        """Which rows DLite drafts this round (``suffix[i]``: the hybrid's suffix draft for row i)."""
        n = len(req_ids)
        phase = self._phase() if self.adaptive_length else "fixed"
        matches = {i: Match(m.tokens[:k], m.probs[:k], m.score) for i, m in enumerate(suffix or []) if m}
        if phase in ("explore-off", "probe-off"):
            return Plan([], {}, phase)
        if phase == "fixed":
            return Plan(list(range(n)), matches, phase)
        if phase != "decide":  # explore-on / probe-on: whole drafts for a share of the batch, in turn
            m = max(1, math.ceil(self.options.explore_share * n))
            first, self._explored = self._explored % max(n, 1), self._explored + m
            return Plan(sorted((first + j) % n for j in range(min(m, n))), matches, phase)
        # would DLite pay for the drafter at all? (running acceptance only: no confidence yet)
        p = [self.acceptance.cumulative(r, "dlite")[:k] for r in req_ids]
        # hybrid: rows whose tree draft already beats what DLite is expected to get are left to the tree
        rows = [i for i in range(n) if not tree_before_drafting(
            matches[i].score if i in matches else None, p[i], self.options.suffix_skip_factor)]
        if not rows:  # every row goes to the tree: no drafter, and no verdict on DLite
            return Plan([], matches, phase)
        choice = choose_lengths([p[i] for i in rows], [k] * len(rows), self.cost, n, self.options.min_gain,
                                with_draft=True)
        if choice.speculate != self.speculating:  # a flip: probe again soon (see _phase)
            self._probe_interval = self.options.probe_every
        self.speculating = choice.speculate
        return Plan(rows if choice.speculate else [], matches, phase)

    # ---------------------------------------------------------------- after drafting
    def select(self, plan: Plan, req_ids: Sequence[str], k: int,
               dlite_confidence: dict) -> tuple[list[int], list[Optional[str]]]:
        """``(tokens to propose, source)`` per row. ``dlite_confidence[row]``: the head's probability
        of each drafted token (rows DLite drafted)."""
        n = len(req_ids)
        caps, p, sources = [0] * n, [np.zeros(0)] * n, [None] * n
        self._confidence = {}
        for i, req_id in enumerate(req_ids):
            match, conf = plan.suffix.get(i), dlite_confidence.get(i)
            if match is None and conf is None:
                continue
            sources[i] = choose_source(len(match.tokens) if match else 0, match.score if match else 0.0,
                                       None if conf is None else expected_from_confidence(conf[:k]))
            if sources[i] == "suffix":
                caps[i], p[i] = len(match.tokens), np.asarray(match.probs, dtype=float)
            else:
                caps[i] = min(k, len(conf))
                self._confidence[i] = list(conf[:caps[i]])
                p[i] = self.calibration.cumulative(conf[:caps[i]])
        if plan.phase in ("fixed", "explore-on", "probe-on"):
            return caps, sources
        if plan.phase in ("explore-off", "probe-off"):
            return [0] * n, sources
        # the draft round is spent either way now: lengths that maximise this round's rate with it
        lengths = choose_lengths(p, caps, self.cost, n, 0.0, with_draft=bool(dlite_confidence),
                                 draft_spent=True).lengths
        return lengths, sources

    def end_round(self, req_ids: Sequence[str], sources: Sequence[Optional[str]],
                  lengths: Sequence[int], phase: str, draft_batch: int, draft_seconds: Optional[float],
                  now: Optional[float] = None) -> None:
        """Remember what each request proposed (attributed at the next ``begin_round``)."""
        for i, (req_id, source, length) in enumerate(zip(req_ids, sources, lengths)):
            if length > 0 and source is not None:
                self._pending[req_id] = (source, int(length), self._confidence.get(i, [])[:length])
            else:
                self._pending[req_id] = ("none", 0, [])
        if draft_seconds is not None and draft_batch > 0:
            self.cost.observe_draft(draft_batch, draft_seconds)
        self.rounds_by_phase[phase] = self.rounds_by_phase.get(phase, 0) + 1
        self.round += 1
        self._last_end = self.clock() if now is None else now

    # ---------------------------------------------------------------- counters
    def retire(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            counters = self.requests.pop(req_id, None)
            self._pending.pop(req_id, None)
            self.acceptance.forget(req_id)
            if counters is None:
                continue
            self.num_finished += 1
            record = counters.as_dict()
            self.finished[req_id] = record
            while len(self.finished) > 4096:
                self.finished.pop(next(iter(self.finished)))
            logger.debug("DLite %s: request %s finished: accepted tokens by source %s", self.options.mode,
                         req_id, {s: record[s]["accepted"] for s in SOURCES})
            if self.options.log_every and self.num_finished % self.options.log_every == 0:
                logger.info("%s", self.summary_line())

    def summary_line(self) -> str:
        parts = []
        for s in SOURCES:
            c = self.totals[s]
            if c.rounds:
                parts.append(f"{s}: {c.accepted} accepted of {c.proposed} proposed in {c.rounds} drafts "
                             f"(tau {1 + c.accepted / c.rounds:.2f})")
        return (f"DLite {self.options.mode}: {self.num_finished} requests finished, {self.round} rounds "
                f"{self.rounds_by_phase}; " + ("; ".join(parts) or "no drafts verified"))

    def stats(self) -> dict:
        """Counters for benchmarks: per source totals, per request (live and finished), the cost
        model and rounds by phase."""
        per_request = dict(self.finished)
        per_request.update({r: c.as_dict() for r, c in self.requests.items()})
        return {"mode": self.options.mode, "rounds": self.round, "rounds_by_phase": dict(self.rounds_by_phase),
                "totals": {s: vars(c).copy() for s, c in self.totals.items()},
                "calibration": self.calibration.summary(),
                "requests": per_request, "cost_model": self.cost.summary(self._last_batch),
                "options": self.options.to_dict()}


__all__ = ["AdaptiveController", "Plan", "RequestCounters", "SourceCounters"]
