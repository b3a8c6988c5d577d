"""Options of ``"dlite-adaptive"`` / ``"dlite-hybrid"`` and the runners they can run on.

The user's ``speculative_config["dlite_options"]`` (:data:`OPTIONS_KEY`) is validated at config time
by :meth:`AdaptiveOptions.from_dict` (one ``ValueError`` naming the bad key and the valid ones) and
reaches the workers as a plain dict in ``VllmConfig.additional_config["dlite_drafting"]``
(:data:`ADDITIONAL_CONFIG_KEY`: a field vLLM passes through unchanged, while ``SpeculativeConfig``
rejects unknown keys), read back by :func:`options_from_vllm_config`. :func:`check_runner` refuses,
with the fix, what the methods cannot run on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from vllm_dlite.vllm.adaptive.cost import COST_KEYS

METHOD_MODES = {"dlite-adaptive": "adaptive", "dlite-hybrid": "hybrid"}
MODES = tuple(METHOD_MODES.values())
OPTIONS_KEY = "dlite_options"  # in the user's speculative_config
ADDITIONAL_CONFIG_KEY = "dlite_drafting"  # in VllmConfig.additional_config


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


__all__ = [
    "ADDITIONAL_CONFIG_KEY", "METHOD_MODES", "MODES", "OPTIONS_KEY", "AdaptiveOptions", "check_runner",
    "options_from_vllm_config", "require_suffix_tree",
]
