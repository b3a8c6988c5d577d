"""Speculation that never costs: adaptive draft length and DLite + suffix-tree hybrid drafts (issue 18).

Two speculative methods on top of ``"dlite"`` (Model Runner V1 only; see :func:`check_runner`):

* ``"dlite-adaptive"``: each round, each request proposes ``0..k`` of the drafted tokens, chosen by
  a **measured** cost model (:class:`~vllm_dlite.vllm.adaptive_cost.CostModel`) from the head's own
  confidence (the sequential head's probability of each token it drafted, calibrated by the
  measured acceptance of tokens drafted with such probabilities:
  :class:`~vllm_dlite.vllm.adaptive_cost.ConfidenceCalibration`). Whether the drafter runs at all
  is decided before it runs, from the requests' recent acceptance
  (:class:`~vllm_dlite.vllm.adaptive_cost.AcceptanceStats`, a running mean per draft position).
  When nothing is expected to be gained the request proposes 0 tokens, and when no request of the
  batch would gain, the drafter does not even run. A request that proposes nothing lets its own
  evidence fade (:meth:`~vllm_dlite.vllm.adaptive_cost.AcceptanceStats.relax`), so it is tried
  again once the population's acceptance says so.
* ``"dlite-hybrid"``: the same, plus a second source per request and per round: arctic-inference's
  suffix tree (:class:`SuffixSource`, the one vLLM's ``"suffix"`` method uses: the request's prompt
  with its tool output and its output so far, plus earlier requests' outputs). Both draft; the
  request proposes the suffix tree's draft when its score (the tree's estimate of accepted drafts)
  beats DLite's own (the sum of the cumulative head probabilities), else DLite's
  (:func:`~vllm_dlite.vllm.adaptive_cost.choose_source`). Before drafting, a request whose tree
  score already beats ``suffix_skip_factor`` x DLite's expected accepted drafts from its running
  acceptance takes the tree's draft without DLite drafting for it, and when every request of the
  batch does, the drafter does not run (``benchmarks/draft_sources.py`` replays the factor's effect
  on tau and on the rounds without a drafter). Per-request counters record which source
  proposed every accepted token (:meth:`AdaptiveController.stats`, :func:`collect_stats`, and one
  log line per finished request at DEBUG, a summary at INFO every ``log_every`` finished requests).

Both are asked for with ``"method"``; options go in ``"dlite_options"`` (validated at config time by
:meth:`AdaptiveOptions.from_dict`)::

    speculative_config={"method": "dlite-adaptive", "model": "<dlite dir>", "num_speculative_tokens": 7,
                        "dlite_options": {"min_gain": 0.05}}

``"dlite-hybrid"`` needs arctic-inference (``bash scripts/install_suffix_decoding.sh``; ``make setup``
builds it); without it the config is refused with that fix.

The plugin maps the method to vLLM's ``"dflash"`` path like ``"dlite"`` and carries the options to
the workers in ``VllmConfig.additional_config["dlite_drafting"]`` (a field vLLM passes through
unchanged; ``SpeculativeConfig`` rejects unknown keys).

Cost model (measured online, no start-up calibration)
-----------------------------------------------------
One speculative cycle is a target step that verifies ``N`` tokens for ``B`` requests plus a draft
round. :class:`~vllm_dlite.vllm.adaptive_cost.CostModel` measures

* ``step(B, N, A) = level + c_req * B + c_tok * (N - B) + c_acc * A``: the wall time from the end
  of one round to the start of the next (scheduling, input preparation, the target forward,
  rejection sampling, output processing), from steps in which every request was decoding
  (``N - B`` = drafts verified, ``A`` = drafts accepted: each is one more token to emit, a cost
  every method pays per output token, which would otherwise be charged to the verified drafts).
  The level drifts (the base step grows with the context), so the slopes are fitted on
  differences of consecutive steps, where it cancels, and the level follows the latest steps
  (one least-squares fit over the window charged the drift to the drafts);
* ``draft(B) = d0 + d1 * B``: the wall time of a round that drafts, from the round's start
  (:meth:`~vllm_dlite.vllm.proposer_v1.DLiteProposer.before_drafting`, before vLLM prepares the
  drafter's inputs) to the end of ``propose``: vLLM's preparation is part of the drafting cost.

It is identified by its own traffic: the first ``explore_rounds`` rounds alternate "propose
nothing" and "propose whole drafts" (for ``explore_share`` of the batch, at least one request, in
turn: at concurrency 16 a round of whole drafts for every request costs several steps), and
afterwards a round does the opposite of the current decision after ``probe_every`` rounds (a
probe, so that neither the cost model nor the acceptance means go stale); the interval doubles
while probes confirm the decision (up to 16x) and resets when the decision flips, so a steady
"off" costs less than 1/(16 probe_every) of a draft round.
``cost_model`` in the options replaces the fit by fixed numbers (tests, experiments).

Decision: with ``p[i][j]`` the probability that request ``i`` accepts its first ``j+1`` drafts
(before drafting: the product of its running conditional acceptance per position; after: the
product of the calibrated head probabilities), the throughput of a round that verifies the set
``S`` of draft tokens is ``(B + sum_S p) / (step(B, B) + c_tok |S| + c_acc sum_S p + draft(B))``;
tokens are added in decreasing ``p`` (prefixes only; for suffix drafts the tree's own cumulative
probabilities) while they raise it. Explore and probe-on rounds propose whole drafts, which is
where the acceptance of the head's unsure tokens is measured. Before drafting, from the running
acceptance alone, the drafter runs only when the best rate beats no speculation,
``B / step(B, B)``, by ``min_gain``; otherwise every
request proposes 0 tokens (or its suffix draft, which costs no drafter). After drafting the draft
time is spent either way, so the lengths then maximise the round's rate with it included.

Not the default: ``"dlite"`` stays fixed-k. The adaptive methods need Model Runner V1 without async
scheduling and without tensor parallelism (per-request lists, per-rank timed decisions), while
vLLM's GPU default is V2 with async scheduling; their online cost model spends its first rounds
exploring, which short runs notice; and a speculative engine that does not draft still pays part of
vLLM's per-step work for speculation (spec-decode metadata every step, the target's aux hidden
states). A round in which nobody drafts skips the rest: vLLM's drafting preparation and the
rejection sampler (:func:`vllm_dlite.vllm.plugin._hook_v1_rounds_without_drafts`). On held-out
code turns of the tiny CPU target, where drafting does not pay, that leaves 0.90-0.99x of no
speculation at concurrency 1 and 0.87-1.05x at 4 and 16 over three runs on a noisy shared host
(``benchmarks/results/README.md``, run 4), so "never costs" means "costs at most that floor".

Lossless: the proposer only shortens (or sources) drafts; vLLM's rejection sampler verifies them
as always. With ``draft_sample_method: "probabilistic"`` the suffix rows carry one-hot draft
probabilities (exact for a deterministic proposal).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from vllm_dlite.vllm.adaptive_cost import (
    COST_KEYS,
    SOURCES,
    AcceptanceStats,
    CostModel,
    ConfidenceCalibration,
    choose_lengths,
    choose_source,
    expected_from_confidence,
    tree_before_drafting,
)

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers

METHOD_MODES = {"dlite-adaptive": "adaptive", "dlite-hybrid": "hybrid"}
MODES = tuple(METHOD_MODES.values())
OPTIONS_KEY = "dlite_options"  # in the user's speculative_config
ADDITIONAL_CONFIG_KEY = "dlite_drafting"  # in VllmConfig.additional_config


# =========================================================================== options
@dataclass(frozen=True)
class AdaptiveOptions:
    """Options of ``dlite-adaptive`` / ``dlite-hybrid`` (``speculative_config["dlite_options"]``)."""

    mode: str = "adaptive"
    calibration_bins: int = 10  # head probabilities calibrated per bin of [0, 1]
    min_gain: float = 0.02  # speculate only when the predicted rate beats no speculation by this
    explore_rounds: int = 6  # first rounds: alternate "nothing" / "whole drafts"
    explore_share: float = 0.25  # explore-on and probe-on rounds draft for this share of the batch
    # (at least one request, in turn): what they measure needs drafts, not a whole batch of them
    probe_every: int = 32  # a round does the opposite of the decision after this many (doubling while
    # the probes confirm it, up to 16x; 0: never)
    window: int = 64  # cost-model observations kept
    cost_decay: float = 0.97  # weight of an observation per newer one
    prior_acceptance: float = 0.6  # conditional acceptance per position before any evidence
    prior_strength: float = 2.0  # pseudo-observations of the prior (request mean -> global mean)
    request_decay: float = 0.8  # running mean per request and position: weight of the past
    global_decay: float = 0.98  # the same, over all requests (the request prior)
    # hybrid: the suffix tree (vLLM's speculative_config suffix_decoding_* options, same defaults)
    suffix_max_tree_depth: int = 24  # longest context suffix matched, and tree depth
    suffix_max_spec_factor: float = 1.0  # draft at most this x the match length
    suffix_min_token_prob: float = 0.1  # stop the draft where the tree's path probability falls below
    suffix_max_cached_requests: int = 10000  # finished requests whose outputs stay in the tree (-1: all)
    suffix_skip_factor: float = 1.5  # hybrid: a row whose tree score beats this x DLite's running expected
    # accepted drafts takes the tree's draft without DLite drafting it (0: DLite always drafts)
    adaptive_length: bool = True  # hybrid: also choose lengths by the cost model (else full drafts)
    log_every: int = 100  # INFO summary every this many finished requests (0: never)
    cost_model: Optional[dict] = None  # fixed costs in seconds instead of the fit (COST_KEYS)

    @classmethod
    def from_dict(cls, mode: str, options: Optional[dict] = None) -> "AdaptiveOptions":
        """Validated options; raises ``ValueError`` naming the bad key and the valid ones."""
        if mode not in MODES:
            raise ValueError(f"unknown DLite drafting mode {mode!r}; choose from {MODES}")
        options = dict(options or {})
        names = {f.name for f in fields(cls)} - {"mode"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"{OPTIONS_KEY}: unknown option(s) {unknown}; valid: {sorted(names)}")
        out = cls(mode=mode, **options)
        out.validate()
        if mode == "hybrid":
            require_suffix_tree()
        return out

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{OPTIONS_KEY}.{name} = {getattr(self, name)!r}: {why}")

        for f in fields(self):  # numbers first: the range checks below compare them
            value = getattr(self, f.name)
            if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                bad(f.name, "must be a number")
        if not isinstance(self.calibration_bins, int) or self.calibration_bins < 1:
            bad("calibration_bins", "must be an integer >= 1")
        if self.min_gain < 0:
            bad("min_gain", "must be >= 0")
        for name in ("explore_rounds", "probe_every", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                bad(name, "must be an integer >= 0")
        if not 0.0 < self.explore_share <= 1.0:
            bad("explore_share", "must be in (0, 1]")
        if not isinstance(self.window, int) or self.window < 4:
            bad("window", "must be an integer >= 4")
        for name in ("cost_decay", "request_decay", "global_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                bad(name, "must be in (0, 1]")
        if not 0.0 < self.prior_acceptance < 1.0:
            bad("prior_acceptance", "must be in (0, 1)")
        if self.prior_strength <= 0:
            bad("prior_strength", "must be > 0")
        if not isinstance(self.suffix_max_tree_depth, int) or self.suffix_max_tree_depth < 1:
            bad("suffix_max_tree_depth", "must be an integer >= 1")
        if self.suffix_skip_factor < 0:
            bad("suffix_skip_factor", "must be >= 0 (0: DLite drafts every row)")
        if self.suffix_max_spec_factor <= 0:
            bad("suffix_max_spec_factor", "must be > 0")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            bad("suffix_min_token_prob", "must be in [0, 1]")
        if not isinstance(self.suffix_max_cached_requests, int) or self.suffix_max_cached_requests < -1:
            bad("suffix_max_cached_requests", "must be an integer >= -1 (-1: no limit)")
        if self.cost_model is not None:
            if not isinstance(self.cost_model, dict) or set(self.cost_model) - set(COST_KEYS):
                bad("cost_model", f"must be a dict with keys among {COST_KEYS} (seconds)")
            if any(float(v) < 0 for v in self.cost_model.values()):
                bad("cost_model", "costs must be >= 0")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def require_suffix_tree() -> None:
    """``dlite-hybrid`` drafts from arctic-inference's suffix tree: refuse the config without it."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"'method': 'dlite-hybrid' drafts from arctic-inference's suffix tree, which is not installed "
            f"({exc}). PyPI has only its source archive: build and install it with bash "
            "scripts/install_suffix_decoding.sh (make setup does), or use 'method': 'dlite-adaptive'") from None


def options_from_vllm_config(vllm_config: Any) -> Optional[AdaptiveOptions]:
    """The drafting options the plugin put in ``additional_config`` (None: plain ``dlite``)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    if not raw:
        return None
    raw = dict(raw)
    return AdaptiveOptions.from_dict(raw.pop("mode"), raw)


def check_runner(options: Optional[AdaptiveOptions], where: str, async_scheduling: bool = False,
                 tensor_parallel_size: int = 1) -> None:
    """Refuse what the adaptive methods cannot run on, with the fix (config/start-up time).

    Model Runner V2 (``where="v2"``): its speculator hands vLLM a fixed ``[B, k]`` draft tensor;
    per-request lengths are not possible there, so the methods fail instead of silently running
    fixed K. V1 with async scheduling: the runner then expects draft tensors, not lists. Tensor
    parallelism: every rank would decide from its own clock, and ranks must agree on the draft
    probabilities used in rejection sampling."""
    if options is None:
        return
    method = next(m for m, mode in METHOD_MODES.items() if mode == options.mode)
    if where == "v2":
        raise ValueError(
            f"'method': '{method}' chooses a draft length per request, which vLLM's Model Runner V2 "
            "(the GPU default) cannot take: set VLLM_USE_V2_MODEL_RUNNER=0 to serve it with Model "
            "Runner V1, or use 'method': 'dlite' (fixed k, or k by batch size with vLLM's "
            "num_speculative_tokens_per_batch_size); why: docs/adaptive-on-v2.md")
    if tensor_parallel_size > 1:
        raise ValueError(
            f"'method': '{method}' decides per rank from measured timings, so tensor-parallel ranks "
            "could disagree: use tensor_parallel_size=1, or 'method': 'dlite' (fixed k) with tensor "
            "parallelism")
    if async_scheduling:
        raise ValueError(
            f"'method': '{method}' hands vLLM per-request draft lists, which Model Runner V1 accepts "
            "only without async scheduling: pass --no-async-scheduling (async_scheduling=False)")


# =========================================================================== per-request counters
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


class Match(NamedTuple):
    """A suffix-tree draft: tokens, the tree's cumulative probability of each, their sum."""
    tokens: list
    probs: list
    score: float


@dataclass
class Plan:
    """What a round does before DLite runs: the rows DLite drafts, the suffix drafts on offer."""
    dlite_rows: list[int]
    suffix: dict  # row -> Match (hybrid; rows with a match)
    phase: str  # "decide" | "explore-off" | "explore-on" | "probe-off" | "probe-on" | "fixed"


# =========================================================================== the hybrid's second source
class SuffixSource:
    """arctic-inference's suffix tree over each request's context, kept as vLLM's ``"suffix"`` method
    keeps it: a request's tree starts from its prompt and grows with its output; a finished request's
    output stays cached (up to ``suffix_max_cached_requests``) for the requests after it."""

    def __init__(self, options: AdaptiveOptions, max_model_len: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.options, self.max_model_len = options, max_model_len
        self.cache = SuffixDecodingCache(max_tree_depth=options.suffix_max_tree_depth,
                                         max_cached_requests=options.suffix_max_cached_requests)
        self._seen: dict[str, int] = {}  # req_id -> context tokens already in its tree

    def draft(self, req_id: str, context: np.ndarray, num_prompt_tokens: int, k: int) -> Optional[Match]:
        """The tree's draft after ``context`` (prompt + output up to the anchor), or None while the
        request is still prefilling (its anchor is not a token of the output yet)."""
        if len(context) <= num_prompt_tokens:
            return None
        if req_id not in self.cache.active_requests:
            if req_id in self.cache.cached_requests:  # a request id used again
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, context[:num_prompt_tokens])
            self._seen[req_id] = num_prompt_tokens
        if len(context) > self._seen[req_id]:
            self.cache.add_active_response(req_id, context[self._seen[req_id]:])
            self._seen[req_id] = len(context)
        o = self.options
        d = self.cache.speculate(req_id, context[max(0, len(context) - o.suffix_max_tree_depth):],
                                 max_spec_tokens=min(k, self.max_model_len - len(context) - 1),
                                 max_spec_factor=o.suffix_max_spec_factor, min_token_prob=o.suffix_min_token_prob)
        return Match(list(d.token_ids), list(d.probs), float(d.score)) if d.token_ids else None

    def retire(self, live_req_ids) -> None:
        """Requests that left the batch: their outputs stay cached for later requests."""
        for req_id in [r for r in self.cache.active_requests if r not in live_req_ids]:
            self.cache.stop_request(req_id)
            self._seen.pop(req_id, None)


# =========================================================================== controller
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


# =========================================================================== engine access
WORKER_STATS_METHOD = "dlite_drafting_stats"
"""The worker method (added to vLLM's ``WorkerBase`` by the plugin) that returns the counters:
``collective_rpc`` with a method NAME works across processes, a function would need vLLM's
insecure-serialization switch."""


def worker_stats(worker) -> Optional[dict]:
    """``WorkerBase.dlite_drafting_stats``: this worker's :meth:`AdaptiveController.stats`, or None
    when its runner has no adaptive drafter."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    controller = getattr(drafter, "controller", None)
    if controller is None:
        return None
    import msgspec  # vLLM's own serializer: its msgpack encoder refuses numpy values on the way back

    return msgspec.to_builtins(controller.stats(), enc_hook=_numpy_to_builtin)


def _numpy_to_builtin(obj):
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    raise NotImplementedError(f"{type(obj).__name__} in the drafting counters")


def collect_stats(llm) -> Optional[dict]:
    """The drafting counters of an ``vllm.LLM`` running ``dlite-adaptive``/``dlite-hybrid``
    (rank 0's; every rank decides the same), or None for other methods. Works with the engine in
    its own process (vLLM's default) and in-process."""
    try:
        out = llm.collective_rpc(WORKER_STATS_METHOD)
    except Exception as exc:  # noqa: BLE001 - report, never break a benchmark
        logger.warning("DLite: could not read the drafting counters: %s", exc)
        return None
    return out[0] if out else None


__all__ = [
    "ADDITIONAL_CONFIG_KEY", "AdaptiveController", "AdaptiveOptions", "METHOD_MODES", "OPTIONS_KEY",
    "Plan", "WORKER_STATS_METHOD", "check_runner", "collect_stats", "options_from_vllm_config",
    "worker_stats",
]
