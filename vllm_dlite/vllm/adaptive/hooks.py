"""Where ``dlite-adaptive`` / ``dlite-hybrid`` meet the plugin and vLLM.

:func:`register` is the one function the plugin (:mod:`vllm_dlite.vllm.plugin`) calls: it returns
the :class:`AdaptiveExtension`, which the plugin asks

* at config time (:meth:`AdaptiveExtension.prepare`, every DLite speculative config): the method's
  ``"dlite_options"``, validated, become ``VllmConfig.additional_config["dlite_drafting"]``; the
  methods are refused where vLLM has no Model Runner V1 (compat group ``"v1 adaptive hooks"``), and
  ``"dlite_options"`` with any other method;
* when Model Runner V1 builds its drafter (:meth:`AdaptiveExtension.v1_proposer`):
  :class:`~vllm_dlite.vllm.adaptive.proposer.AdaptiveDLiteProposer` for these methods;
* when Model Runner V2 builds its speculator (:meth:`AdaptiveExtension.check_v2`): a refusal with
  the fix (V2 takes one draft length per step);
* for its runner hooks (:attr:`AdaptiveExtension.hooks`, installed where their compat group holds):
  :func:`hook_v1_rounds_without_drafts` and :func:`hook_worker_base`.

Engine access: :func:`collect_stats` reads the drafting counters of a ``vllm.LLM`` through the
worker method :data:`WORKER_STATS_METHOD`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import numpy as np

from vllm_dlite.vllm import compat
from vllm_dlite.vllm.adaptive.options import (
    ADDITIONAL_CONFIG_KEY,
    METHOD_MODES,
    OPTIONS_KEY,
    AdaptiveOptions,
    check_runner,
    options_from_vllm_config,
)

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers

_WRAPPED = "__dlite_wrapped__"  # marks a vLLM function already wrapped (the plugin's marker)

WORKER_STATS_METHOD = "dlite_drafting_stats"
"""The worker method (added to vLLM's ``WorkerBase`` by :func:`hook_worker_base`) that returns the
counters: ``collective_rpc`` with a method NAME works across processes, a function would need
vLLM's insecure-serialization switch."""


# =========================================================================== runner hooks
def hook_v1_rounds_without_drafts(module) -> None:
    """Model Runner V1 (``vllm.v1.worker.gpu_model_runner``): a round in which nobody drafts costs
    what a step without speculation costs, as far as vLLM's runner allows.

    * ``propose_draft_token_ids``: before vLLM prepares the drafter's inputs (next tokens, padded
      metadata, the aux hidden states of every scheduled token), the proposer's controller learns
      from the verify step and plans the round
      (:meth:`~vllm_dlite.vllm.adaptive.proposer.AdaptiveDLiteProposer.before_drafting`); when no
      request drafts, the round ends there with empty drafts.
    * ``_sample``: a step in which no request carries drafts is sampled by vLLM's sampler, as
      without speculation, instead of the rejection sampler with nothing to verify.

    Other drafters, and plain ``"dlite"``, go straight to vLLM's methods."""
    cls = module.GPUModelRunner
    propose_all, sample = cls.propose_draft_token_ids, cls._sample
    if getattr(propose_all, _WRAPPED, False):
        return

    def controller(runner):
        return getattr(getattr(runner, "drafter", None), "controller", None)

    @functools.wraps(propose_all)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        if controller(self) is not None:
            drafts = self.drafter.before_drafting(scheduler_output, sampled_token_ids, spec_decode_metadata,
                                                  common_attn_metadata)
            if drafts is not None:
                return drafts
        return propose_all(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                           sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                           slot_mappings)

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0 \
                and controller(self) is not None:
            spec_decode_metadata = None  # nothing to verify: logits hold one row per request
        return sample(self, logits, spec_decode_metadata)

    for wrapper in (propose_draft_token_ids, _sample):
        setattr(wrapper, _WRAPPED, True)
    cls.propose_draft_token_ids, cls._sample = propose_draft_token_ids, _sample


def hook_worker_base(module) -> None:
    """Every worker answers ``collective_rpc("dlite_drafting_stats")`` (adaptive/hybrid counters);
    an added method, nothing of vLLM's is replaced."""
    if not hasattr(module.WorkerBase, WORKER_STATS_METHOD):
        setattr(module.WorkerBase, WORKER_STATS_METHOD, worker_stats)


# =========================================================================== the plugin's extension
class AdaptiveExtension:
    """``dlite-adaptive`` / ``dlite-hybrid`` as the plugin sees them (see the module docstring)."""

    methods: tuple[str, ...] = tuple(METHOD_MODES)
    additional_config_keys: tuple[str, ...] = (ADDITIONAL_CONFIG_KEY,)
    # (vLLM module, compat group the hook needs, hook): applied right after the module is imported
    hooks: tuple[tuple[str, str, Callable], ...] = (
        ("vllm.v1.worker.worker_base", compat.V1_ADAPTIVE.name, hook_worker_base),
        ("vllm.v1.worker.gpu_model_runner", compat.V1_ADAPTIVE.name, hook_v1_rounds_without_drafts),
    )

    def prepare(self, method: Optional[str], spec: dict[str, Any]) -> dict[str, Any]:
        """A DLite speculative config (``method``: the user's) after its checkpoint is validated:
        pops ``"dlite_options"`` from ``spec`` and returns the entries the workers read from
        ``additional_config`` (none for other methods). ``ValueError`` naming the fix."""
        options = spec.pop(OPTIONS_KEY, None)
        mode = METHOD_MODES.get(method)
        if mode is not None and compat.V1_ADAPTIVE.name not in compat.holding_groups():
            raise ValueError(f"'method': '{method}' needs Model Runner V1, which vLLM {compat.installed_version()} "
                             "does not have (compat group 'v1 adaptive hooks'): use 'method': 'dlite' (fixed k)")
        if options is not None and mode is None:
            raise ValueError(
                f'speculative_config "{OPTIONS_KEY}" applies to "method": "dlite-adaptive" or '
                f'"dlite-hybrid", not {method!r}')
        if mode is None:
            return {}
        return {ADDITIONAL_CONFIG_KEY: AdaptiveOptions.from_dict(mode, options).to_dict()}

    def v1_proposer(self, vllm_config: Any) -> Optional[type]:
        """The Model Runner V1 proposer class for an engine of these methods, else None."""
        if options_from_vllm_config(vllm_config) is None:
            return None
        from vllm_dlite.vllm.adaptive.proposer import AdaptiveDLiteProposer  # imports vLLM's proposer

        return AdaptiveDLiteProposer

    def check_v2(self, vllm_config: Any) -> None:
        """These methods need Model Runner V1: fail with the fix."""
        check_runner(options_from_vllm_config(vllm_config), "v2")


def register() -> AdaptiveExtension:
    """The adaptive methods' registration: the extension the plugin serves them through."""
    return AdaptiveExtension()


# =========================================================================== engine access
def worker_stats(worker) -> Optional[dict]:
    """``WorkerBase.dlite_drafting_stats``: this worker's
    :meth:`~vllm_dlite.vllm.adaptive.controller.AdaptiveController.stats`, or None when its runner
    has no adaptive drafter."""
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
    "WORKER_STATS_METHOD", "AdaptiveExtension", "collect_stats", "hook_v1_rounds_without_drafts",
    "hook_worker_base", "register", "worker_stats",
]
