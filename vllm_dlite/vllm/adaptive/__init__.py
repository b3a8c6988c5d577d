"""Adaptive drafting: two speculative methods on a DLite checkpoint besides ``"dlite"`` (issue 18).

* ``"dlite-adaptive"``: each round, each request proposes ``0..k`` of the drafted tokens, chosen by
  a measured cost model from the head's own confidence; when no request of the batch would gain,
  the drafter does not run.
* ``"dlite-hybrid"``: the same, plus arctic-inference's suffix tree as a second source per request
  and per round (needs arctic-inference: ``bash scripts/install_suffix_decoding.sh``; ``make setup``
  builds it; without it the config is refused with that fix).

Both are asked for with ``"method"``; options go in ``"dlite_options"``::

    speculative_config={"method": "dlite-adaptive", "model": "<dlite dir>",
                        "dlite_options": {"min_gain": 0.05}}

Contract: lossless (only the drafts' lengths and sources change; vLLM's rejection sampler verifies
them as always); Model Runner V1 only, without async scheduling and without tensor parallelism
(:func:`~vllm_dlite.vllm.adaptive.options.check_runner` refuses the rest with the fix;
``docs/adaptive-on-v2.md`` says why V2 cannot take them); not the default (``"dlite"`` stays
fixed-k). A speculative engine in which nobody drafts still pays part of vLLM's per-step work for
speculation (spec-decode metadata every step, the target's aux hidden states); the rounds without
drafts skip vLLM's drafting preparation and its rejection sampler. What that costs in measured
runs is in ``benchmarks/results/README.md``.

Modules (none imports vLLM at import time but :mod:`.proposer`):

* :mod:`.options`     ``AdaptiveOptions`` (``"dlite_options"``), the runners the methods refuse;
* :mod:`.cost`        the numbers the decisions are made by (acceptance, calibration, cost model);
* :mod:`.controller`  ``AdaptiveController``: the round-by-round policy;
* :mod:`.suffix`      ``SuffixSource``: the hybrid's suffix tree;
* :mod:`.proposer`    ``AdaptiveDLiteProposer``: the Model Runner V1 proposer;
* :mod:`.hooks`       ``register()``: what the plugin calls; the runner hooks; ``collect_stats``.
"""

from vllm_dlite.vllm.adaptive.controller import AdaptiveController, Plan
from vllm_dlite.vllm.adaptive.hooks import WORKER_STATS_METHOD, collect_stats, register, worker_stats
from vllm_dlite.vllm.adaptive.options import (
    ADDITIONAL_CONFIG_KEY,
    METHOD_MODES,
    OPTIONS_KEY,
    AdaptiveOptions,
    check_runner,
    options_from_vllm_config,
)
from vllm_dlite.vllm.adaptive.suffix import Match, SuffixSource

__all__ = [
    "ADDITIONAL_CONFIG_KEY", "AdaptiveController", "AdaptiveOptions", "METHOD_MODES", "Match", "OPTIONS_KEY",
    "Plan", "SuffixSource", "WORKER_STATS_METHOD", "check_runner", "collect_stats", "options_from_vllm_config",
    "register", "worker_stats",
]
