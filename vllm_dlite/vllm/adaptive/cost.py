"""The numbers adaptive drafting (:mod:`vllm_dlite.vllm.adaptive`) decides by, on plain Python and
NumPy inputs (no vLLM): per-request and per-source draft acceptance (:class:`AcceptanceStats`, a
decayed running mean per draft position with the population as prior), the head's probabilities
calibrated by measured acceptance (:class:`ConfidenceCalibration`), the measured cost of a verify
step and of a draft round (:class:`CostModel`: slopes from consecutive steps under a drifting
level, a least-squares draft cost, or fixed costs), and the decision rules: the draft lengths that maximise predicted tokens per second
(:func:`choose_lengths`, all zero when speculation does not pay by ``min_gain``) and which source a
hybrid request uses (:func:`choose_source`: the one expected to get more tokens accepted). The
round-by-round policy (exploration, probes, counters) is
:class:`~vllm_dlite.vllm.adaptive.controller.AdaptiveController`'s.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence

import numpy as np

SOURCES = ("dlite", "suffix")
COST_KEYS = ("step_s", "request_s", "token_s", "accepted_s", "draft_s", "draft_request_s")


# =========================================================================== acceptance
class AcceptanceStats:
    """Running conditional acceptance per draft position, per request and source.

    ``alpha[j]`` = P(draft position j accepted | positions < j accepted). Per request it is a
    decayed count ``(acc_j + m g_j) / (n_j + m)`` whose prior ``g_j`` is the same mean over all
    requests (itself starting at ``prior``), so a new request starts at the population's rate and
    a position a request never proposed keeps the population's value. Plain lists: it runs per
    request and round on K <= 16 numbers, where NumPy's per-call cost dominates."""

    def __init__(self, num_draft_tokens: int, prior: float = 0.6, strength: float = 2.0,
                 request_decay: float = 0.8, global_decay: float = 0.98):
        self.num_draft_tokens = num_draft_tokens
        self.prior, self.strength = prior, strength
        self.request_decay, self.global_decay = request_decay, global_decay
        self._global = {s: ([0.0] * num_draft_tokens, [0.0] * num_draft_tokens) for s in SOURCES}
        self._req: dict[str, dict[str, tuple[list, list]]] = {}

    def observe(self, req_id: str, source: str, proposed: int, accepted: int) -> None:
        """One verification: ``accepted`` of the ``proposed`` drafts (positions past the first
        rejection are not observed)."""
        proposed = min(int(proposed), self.num_draft_tokens)
        accepted = max(0, min(int(accepted), proposed))
        if proposed <= 0:
            return
        seen = min(accepted + 1, proposed)
        K = self.num_draft_tokens
        racc, rn = self._req.setdefault(req_id, {}).setdefault(source, ([0.0] * K, [0.0] * K))
        gacc, gn = self._global[source]
        for acc, n, d in ((racc, rn, self.request_decay), (gacc, gn, self.global_decay)):
            for j in range(seen):
                acc[j] = acc[j] * d + (1.0 if j < accepted else 0.0)
                n[j] = n[j] * d + 1.0

    def global_alpha(self, source: str) -> list[float]:
        gacc, gn = self._global[source]
        m, prior = self.strength, self.prior
        return [(a + m * prior) / (n + m) for a, n in zip(gacc, gn)]

    def alpha(self, req_id: str, source: str) -> list[float]:
        g = self.global_alpha(source)
        rec = self._req.get(req_id, {}).get(source)
        if rec is None:
            return g
        m = self.strength
        return [(a + m * gj) / (n + m) for a, n, gj in zip(*rec, g)]

    def cumulative(self, req_id: str, source: str) -> list[float]:
        """``p[j]`` = P(the first j+1 drafts are all accepted)."""
        return list(accumulate(self.alpha(req_id, source), operator.mul))

    def relax(self, req_id: str) -> None:
        """A round in which the request proposed nothing: its own evidence fades at the request
        decay, so its estimate drifts back to the population's and it is tried again (without
        this a request that once looked bad would never draft again: no draft, no evidence)."""
        d = self.request_decay
        for acc, n in self._req.get(req_id, {}).values():
            acc[:] = [v * d for v in acc]
            n[:] = [v * d for v in n]

    def forget(self, req_id: str) -> None:
        self._req.pop(req_id, None)


class ConfidenceCalibration:
    """The head's probability of the token it drafted, calibrated by measured acceptance.

    ``alpha(q)`` = P(a draft token is accepted | the drafts before it were, the head gave it
    probability ``q``): a decayed count per bin of ``q`` (``bins`` equal bins of [0, 1]) whose prior
    is ``q`` itself with weight ``strength``, so the head is trusted until its bin has evidence. The
    tokens of a verified draft are observed up to the first rejected one (the rest are not seen)."""

    def __init__(self, bins: int = 10, strength: float = 2.0, decay: float = 0.98):
        self.bins, self.strength, self.decay = bins, strength, decay
        self.acc, self.n = [0.0] * bins, [0.0] * bins

    def _bin(self, q: float) -> int:
        return min(max(int(q * self.bins), 0), self.bins - 1)

    def observe(self, confidence: Sequence[float], accepted: int) -> None:
        seen = min(int(accepted) + 1, len(confidence))
        for j in range(seen):
            b = self._bin(float(confidence[j]))
            self.acc[b] = self.acc[b] * self.decay + (1.0 if j < accepted else 0.0)
            self.n[b] = self.n[b] * self.decay + 1.0

    def alpha(self, confidence: Sequence[float]) -> list[float]:
        m = self.strength
        return [(self.acc[b] + m * q) / (self.n[b] + m)
                for q, b in ((float(q), self._bin(float(q))) for q in confidence)]

    def cumulative(self, confidence: Sequence[float]) -> list[float]:
        """``p[j]`` = P(the first j+1 drafts are all accepted)."""
        return list(accumulate(self.alpha(confidence), operator.mul))

    def summary(self) -> list:
        """Per bin: (measured acceptance or None, observations)."""
        return [(None if n < 1e-9 else a / n, n) for a, n in zip(self.acc, self.n)]


# =========================================================================== cost model
class _WeightedFit:
    """Exponentially weighted least squares over the last ``window`` rows, with a tiny ridge
    towards zero on every coefficient but the intercept (keeps it defined without variation);
    observations above 3x the window's median are clipped to it (one-off stalls). Refitted every
    ``refit_every`` new rows (it runs each round)."""

    def __init__(self, num_features: int, window: int, decay: float, refit_every: int = 4):
        self.num_features, self.window, self.decay, self.refit_every = num_features, window, decay, refit_every
        self.x: list[list[float]] = []
        self.y: list[float] = []
        self._coef: Optional[np.ndarray] = None
        self._new = 0  # rows since the last fit

    def add(self, x: Sequence[float], y: float) -> None:
        self.x.append([1.0, *map(float, x)])
        self.y.append(float(y))
        if len(self.y) > self.window:
            del self.x[0], self.y[0]
        self._new += 1

    def __len__(self) -> int:
        return len(self.y)

    def coef(self) -> Optional[np.ndarray]:
        if not self.y:
            return None
        if self._coef is None or self._new >= self.refit_every:
            self._new = 0
            X, y = np.asarray(self.x), np.asarray(self.y)
            y = np.minimum(y, 3.0 * np.median(y))  # one-off stalls (first calls, a busy host)
            w = np.sqrt(self.decay ** np.arange(len(y) - 1, -1, -1))
            scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
            A = np.vstack([X / scale * w[:, None], np.diag([0.0] + [1e-3] * (X.shape[1] - 1))])
            b = np.concatenate([y * w, np.zeros(X.shape[1])])
            self._coef = np.linalg.lstsq(A, b, rcond=None)[0] / scale
        return self._coef


class _StepFit:
    """A verify step ``y = level + c . x`` (``x = (B, N - B, A)``) whose level drifts.

    The base step grows with the context (attention over a longer KV cache) and moves when a
    request joins or the host gets busy, so one least-squares fit over a window mixes contexts and
    charges their drift to whatever correlates with it in time (the drafts). Here the slopes ``c``
    come from **differences of consecutive steps**, in which the level cancels: least squares
    through the origin over the last ``window`` differences, refitted without those whose residual
    exceeds 3x the median one (stalls), every ``refit_every`` new differences (it runs each round).
    The level is an exponentially weighted mean of ``y - c . x`` (weight ``level_decay`` on the
    past; observations clipped to 3x the window's median), so it follows the context."""

    def __init__(self, window: int, level_decay: float = 0.5, refit_every: int = 4):
        self.window, self.level_decay, self.refit_every = window, level_decay, refit_every
        self.dx: list[list[float]] = []
        self.dy: list[float] = []
        self.y: list[float] = []  # recent steps (median: stalls, idle gaps)
        self.level: Optional[float] = None
        self._last: Optional[tuple[list[float], float]] = None
        self._coef = np.zeros(3)
        self._new = 0  # differences since the last fit
        self._median: Optional[tuple[int, float]] = None  # (observations then, median)
        self._count = 0

    def add(self, x: Sequence[float], y: float, consecutive: bool) -> None:
        x = [float(v) for v in x]
        if consecutive and self._last is not None and x != self._last[0]:
            self.dx.append([a - b for a, b in zip(x, self._last[0])])
            self.dy.append(y - self._last[1])
            if len(self.dy) > self.window:
                del self.dx[0], self.dy[0]
            self._new += 1
            if self._new >= self.refit_every or not self._coef.any():
                self._fit()
        self._last = (x, y)
        self.y.append(y)
        if len(self.y) > self.window:
            del self.y[0]
        self._count += 1
        r = min(y, 3.0 * self.median()) - sum(c * v for c, v in zip(self._coef, x))
        self.level = r if self.level is None else self.level_decay * self.level + (1 - self.level_decay) * r

    def median(self) -> float:
        """Median step of the window (recomputed every 8 observations)."""
        if self._median is None or self._median[0] + 8 <= self._count or len(self.y) < 8:
            self._median = (self._count, float(np.median(self.y)))
        return self._median[1]

    def __len__(self) -> int:
        return len(self.y)

    def varied(self, column: int) -> bool:
        """Some difference moved feature ``column`` (its slope is identified)."""
        return any(d[column] != 0 for d in self.dx)

    def _fit(self) -> None:
        X, y = np.asarray(self.dx), np.asarray(self.dy)
        c = np.linalg.lstsq(X, y, rcond=None)[0]
        for _ in range(2):  # drop stalls: residuals above 3x the median one
            r = np.abs(y - X @ c)
            keep = r <= 3.0 * np.median(r) + 1e-12
            c = np.linalg.lstsq(X[keep], y[keep], rcond=None)[0]
        self._coef = np.maximum(c, 0.0)
        self._new = 0

    def coef(self) -> np.ndarray:
        return self._coef


class CostModel:
    """Measured step and draft costs (seconds): see the module docstring of
    :mod:`vllm_dlite.vllm.adaptive.controller` ("Cost model")."""

    def __init__(self, fixed: Optional[dict] = None, window: int = 64, decay: float = 0.97,
                 level_decay: float = 0.5):
        self.fixed = None if fixed is None else {k: float(fixed.get(k, 0.0)) for k in COST_KEYS}
        self._step = _StepFit(window, level_decay)  # x = (B, N - B, A)
        self._draft = _WeightedFit(1, window, decay)  # x = (B,): no drift (the drafter keeps no history)

    # ---------------------------------------------------------------- observations
    def observe_step(self, batch_size: int, num_tokens: int, seconds: float, accepted: int = 0,
                     consecutive: bool = True) -> None:
        """A verify step of ``batch_size`` requests and ``num_tokens`` tokens in which ``accepted``
        drafts were accepted (each one more token to emit: output processing, detokenising);
        ``consecutive``: the previous observation was the step just before this one."""
        self._step.add((batch_size, num_tokens - batch_size, accepted), seconds, consecutive)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        self._draft.add((batch_size,), seconds)

    @property
    def ready(self) -> bool:
        """Fixed, or measured across a change of the drafts verified (so the per-token slope is
        identified) and with a draft round."""
        return self.fixed is not None or (self._step.varied(1) and len(self._draft) > 0)

    def typical_step_seconds(self) -> Optional[float]:
        """Median verify step of the window (recomputed every 8 observations: it runs each round)."""
        return self._step.median() if len(self._step) else None

    # ---------------------------------------------------------------- predictions
    def step_seconds(self, batch_size: int, num_tokens: Optional[int] = None) -> float:
        """Verify step for ``batch_size`` requests and ``num_tokens`` tokens (default: no drafts)."""
        num_tokens = batch_size if num_tokens is None else num_tokens
        if self.fixed is not None:
            f = self.fixed
            return f["step_s"] + f["request_s"] * batch_size + f["token_s"] * (num_tokens - batch_size)
        if self._step.level is None:
            return 0.0
        base = max(self._step.level + self._step.coef()[0] * batch_size, 1e-6)
        return base + self.token_seconds(batch_size) * (num_tokens - batch_size)

    def token_seconds(self, batch_size: int = 1) -> float:
        """Marginal cost of one more draft token in a verify step (>= 0)."""
        if self.fixed is not None:
            return self.fixed["token_s"]
        return float(self._step.coef()[1])

    def accepted_seconds(self) -> float:
        """Cost of one more emitted token (an accepted draft) in a step (>= 0), whatever the method:
        without this term it would be charged to the verified tokens, which it correlates with."""
        if self.fixed is not None:
            return self.fixed["accepted_s"]
        return float(self._step.coef()[2])

    def draft_seconds(self, batch_size: int) -> float:
        if self.fixed is not None:
            return self.fixed["draft_s"] + self.fixed["draft_request_s"] * batch_size
        c = self._draft.coef()
        if c is None:
            return 0.0
        return max(float(c[0] + c[1] * batch_size), 0.0)

    def summary(self, batch_size: int = 1) -> dict:
        return {"fixed": self.fixed is not None, "ready": self.ready,
                "step_s": self.step_seconds(batch_size), "token_s": self.token_seconds(batch_size),
                "accepted_s": self.accepted_seconds(), "draft_s": self.draft_seconds(batch_size),
                "batch_size": batch_size,
                "step_samples": len(self._step), "draft_samples": len(self._draft)}


# =========================================================================== decisions
@dataclass
class Choice:
    lengths: list[int]  # tokens to propose per row
    rate: float  # predicted tokens/s of the chosen round
    base_rate: float  # predicted tokens/s without speculation
    speculate: bool


def choose_lengths(p: Sequence[Sequence[float]], caps: Sequence[int], cost: CostModel,
                   batch_size: Optional[int] = None, min_gain: float = 0.0,
                   with_draft: bool = True, draft_spent: bool = False) -> Choice:
    """Draft lengths maximising predicted throughput.

    ``p[i][j]``: probability that row i's first j+1 drafts are accepted (non-increasing in j);
    ``caps[i]``: at most this many (the draft's length). Greedy: tokens in decreasing ``p`` join
    while each raises ``(B + sum p) / (T0 + c_tok |S| + c_acc sum p + D)`` (``c_acc``: the cost of an
    emitted token). All zero when the best rate does not beat ``B / T0`` by ``min_gain``
    (``B / (T0 + D)`` when ``draft_spent``: the draft round already ran, so proposing nothing would
    not give its time back)."""
    n = len(caps)
    B = n if batch_size is None else batch_size
    base = cost.step_seconds(B)
    token_s, accepted_s = cost.token_seconds(B), cost.accepted_seconds()
    draft_s = cost.draft_seconds(B) if with_draft else 0.0
    base_rate = B / (base + (draft_s if draft_spent else 0.0)) if base > 0 else math.inf
    cands = sorted(((float(p[i][j]), j, i) for i in range(n) for j in range(min(caps[i], len(p[i])))),
                   key=lambda t: (-t[0], t[1]))
    lengths = [0] * n
    tokens, seconds = float(B), base + draft_s
    for pij, j, i in cands:
        if j != lengths[i] or pij <= 0.0:
            continue
        if pij * seconds <= tokens * (token_s + accepted_s * pij):  # it would not raise the rate
            break
        tokens += pij
        seconds += token_s + accepted_s * pij
        lengths[i] += 1
    rate = tokens / seconds if seconds > 0 else math.inf
    speculate = sum(lengths) > 0 and (rate > base_rate * (1.0 + min_gain) or base_rate == math.inf)
    if not speculate:
        lengths = [0] * n
    return Choice(lengths, rate, base_rate, speculate)


def expected_from_confidence(confidence: Sequence[float]) -> float:
    """The head's own estimate of the accepted drafts: ``sum_j prod_{i<=j} q_i`` over the
    probabilities ``q`` of the drafted tokens."""
    return sum(accumulate(map(float, confidence), operator.mul))


def choose_source(suffix_len: int, suffix_score: float, dlite_expected: Optional[float]) -> str:
    """Hybrid: the suffix tree proposes when it matched (``suffix_len > 0``) and its score (the
    tree's estimate of the accepted drafts: the sum of its path probabilities) beats DLite's
    (:func:`expected_from_confidence`; None: DLite did not draft this round); else DLite.
    ``lab/experiments/draft_sources.py`` compares this rule with fixed thresholds and with vLLM's n-gram
    matcher on greedy traces."""
    if suffix_len <= 0:
        return "dlite"
    return "suffix" if dlite_expected is None or suffix_score > dlite_expected else "dlite"


def tree_before_drafting(suffix_score: Optional[float], running_p: Sequence[float], factor: float) -> bool:
    """Hybrid, before DLite drafts: the suffix tree's draft (``suffix_score``; None: no match) is
    taken without DLite drafting when its score beats ``factor`` x DLite's expected accepted drafts
    from the request's running acceptance (``running_p``: its cumulative acceptance per position).
    ``factor`` 0: never (DLite always drafts)."""
    return bool(factor) and suffix_score is not None and suffix_score > factor * sum(running_p)


__all__ = [
    "COST_KEYS", "SOURCES", "AcceptanceStats", "Choice", "ConfidenceCalibration", "CostModel",
    "choose_lengths", "choose_source", "expected_from_confidence", "tree_before_drafting",
]
