"""Unit tests of ``vllm_dlite.vllm.cpu_fixes``: each patch called on the inputs that break vLLM's
own function (which is shown to fail on them), and the scope (nothing is applied without a
speculative config). Fast: no engine is started. The end-to-end check is
``tests/test_sampling_matrix.py`` (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


pytest.importorskip("vllm")

from vllm_dlite.vllm import cpu_fixes, plugin


# ----------------------------------------------------------------------------- scope
def test_register_only_arranges_the_hook(monkeypatch):
    """``register()`` (installing ``runner_hooks()``) applies nothing: it hooks the CPU runner class."""
    def refuse(*_a, **_k):
        raise AssertionError("a fix was applied without a speculative runner")

    monkeypatch.setattr(cpu_fixes, "apply_for_runner", refuse)
    plugin.register()
    plugin._install_runner_hooks()  # idempotent, applies nothing
    assert cpu_fixes.runner_hooks() == {cpu_fixes.CPU_RUNNER_MODULE: cpu_fixes.hook_cpu_runner}
    assert plugin._HOOKS[cpu_fixes.CPU_RUNNER_MODULE] == [("cpu fixes", cpu_fixes.hook_cpu_runner)]
    import vllm.v1.worker.cpu_model_runner as cpu_runner

    assert getattr(cpu_runner.CPUModelRunner.__init__, cpu_fixes._FIXED, False)


def test_fixes_apply_only_to_runners_with_a_speculative_config(monkeypatch):
    applied = []
    monkeypatch.setattr(cpu_fixes, "apply_for_runner", applied.append)

    class CPUModelRunner:  # stands in for vLLM's; the hook wraps its __init__
        def __init__(self, vllm_config, device):
            self.speculative_config = vllm_config.speculative_config

    module = SimpleNamespace(CPUModelRunner=CPUModelRunner)
    cpu_fixes.hook_cpu_runner(module)
    cpu_fixes.hook_cpu_runner(module)  # idempotent: one wrapper
    plain = CPUModelRunner(SimpleNamespace(speculative_config=None), "cpu")
    assert applied == []
    spec = CPUModelRunner(SimpleNamespace(speculative_config=object()), "cpu")
    assert applied == [spec] and plain not in applied


# ----------------------------------------------------------------------------- 1. expand kernel
def _import_cpu_kernels():
    """vLLM's C++ CPU kernels, the build for this CPU, as a worker loads them: ``vllm._C`` is the
    AVX-512 BF16 build and dies of an illegal instruction on an AVX2-only host."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()


def test_expand_kernel_fix():
    """vLLM's CPU expand kernel leaves float outputs uninitialised (it writes an int64 copy); the
    fix fills them (temperature / top-p per draft token) and keeps the C++ kernel for int64."""
    _import_cpu_kernels()
    from vllm.utils import cpu_triton_utils as cpu_tl

    cpu_fixes.fix_expand_kernel()
    fixed = cpu_tl._expand_kernel_impl
    assert getattr(fixed, cpu_fixes._FIXED, False)
    temps = torch.tensor([0.0, 0.7, 1.3])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # inclusive cumsum: 2, 0, 3 tokens
    out = torch.full((5,), -9.0)
    fixed.__wrapped__(out, temps, cu, 0, 1)  # vLLM's own
    assert out.tolist() == [-9.0] * 5, "vLLM's CPU expand kernel writes its float output now"
    fixed(out, temps, cu, 0, 1)
    assert out.tolist() == pytest.approx([1.0, 1.0, 1.3, 1.3, 1.3])
    ints = torch.full((5,), -9, dtype=torch.int32)
    fixed(ints, torch.tensor([4, 5, 6], dtype=torch.int32), cu, 0, 0)
    assert ints.tolist() == [4, 4, 6, 6, 6]
    longs = torch.full((5,), -9, dtype=torch.int64)
    fixed(longs, torch.tensor([4, 5, 6]), cu, 0, 0)  # through vLLM's C++ kernel
    assert longs.tolist() == [4, 4, 6, 6, 6]


def test_expand_kernel_fix_reaches_the_rejection_sampler(monkeypatch):
    """Applied after the CPU worker registered vLLM's kernel overrides (as it is, at runner init),
    the fix replaces the registered override: ``expand_batch_to_tokens`` gives the right values."""
    _import_cpu_kernels()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import cpu_triton_utils as cpu_tl
    from vllm.v1.sample import rejection_sampler as rs

    cpu_fixes.fix_expand_kernel()
    monkeypatch.setattr(cpu_tl, "_expand_kernel_impl", cpu_tl._expand_kernel_impl.__wrapped__)
    CpuPlatform.register_triton_kernel_overrides()  # the worker does this before the runner exists
    temps = torch.tensor([0.0, 0.7, 1.3])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    cpu_fixes.fix_expand_kernel()
    expanded = rs.expand_batch_to_tokens(temps, cu, 5, replace_from=0, replace_to=1)
    assert expanded.tolist() == pytest.approx([1.0, 1.0, 1.3, 1.3, 1.3])


# ----------------------------------------------------------------------------- 2. top-k, no drafts
def _cpu_kernels_as_in_a_worker():
    """vLLM's CPU kernel overrides + the expand fix, as a speculative CPU worker has them."""
    _import_cpu_kernels()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    if cpu_fixes.EXPAND_KERNEL not in dispatcher._registry:
        CpuPlatform.register_triton_kernel_overrides()
    cpu_fixes.fix_expand_kernel()


def _metadata(temperature, top_k=None, top_p=None):
    return SimpleNamespace(all_greedy=False, temperature=torch.tensor(temperature),
                           top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
                           top_p=None if top_p is None else torch.tensor(top_p))


def test_top_k_on_a_step_without_drafts():
    """A step in which no request has draft tokens (prefill) gives the rejection sampler [0, V]
    target logits; with top_k vLLM's ``apply_sampling_constraints`` reduces an empty tensor."""
    from vllm.v1.sample import rejection_sampler as rs

    _cpu_kernels_as_in_a_worker()
    cpu_fixes.fix_empty_sampling_constraints()
    fixed = rs.apply_sampling_constraints
    assert getattr(fixed, cpu_fixes._FIXED, False)
    empty = torch.zeros(0, 50)
    no_drafts = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="numel\\(\\) == 0"):
        fixed.__wrapped__(empty.clone(), no_drafts, _metadata([1.0], top_k=[5]))  # vLLM's own
    assert fixed(empty.clone(), no_drafts, _metadata([1.0], top_k=[5])).shape == (0, 50)
    for top_k, top_p in (([5], None), (None, [0.9]), ([5], [0.9])):
        assert fixed(empty.clone(), no_drafts, _metadata([1.0], top_k, top_p)).shape == (0, 50)


def test_top_k_with_drafts_is_unchanged():
    """With draft tokens the fixed function is vLLM's: temperature, top-k and top-p per token."""
    from vllm.v1.sample import rejection_sampler as rs

    _cpu_kernels_as_in_a_worker()
    cpu_fixes.fix_empty_sampling_constraints()
    fixed = rs.apply_sampling_constraints
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2, 0 and 3 draft tokens
    meta = _metadata([0.5, 1.0, 2.0], top_k=[3, 50, 7], top_p=[1.0, 1.0, 0.8])
    got = fixed(logits.clone(), cu, meta)
    assert torch.equal(got, fixed.__wrapped__(logits.clone(), cu, meta))
    kept = torch.isfinite(got).sum(-1).tolist()
    assert kept[:2] == [3, 3] and all(k <= 7 for k in kept[2:])
    row = got[0][torch.isfinite(got[0])]  # request 0: temperature 0.5, top-k 3
    assert torch.allclose(row.sort().values, (logits[0] / 0.5).topk(3).values.sort().values)


# ----------------------------------------------------------------------------- 3. seed + chunks
class _Reached(Exception):
    """Raised by the stub batch right after ``_bookkeeping_sync``'s generator rewind."""


class _StubBatch:
    def __init__(self, generators):
        self.num_reqs = 2
        self.generators = generators

    @property
    def req_ids(self):  # the first thing _bookkeeping_sync reads after the rewind loop
        raise _Reached


def _stub_runner(generators):
    """What vLLM's ``GPUModelRunner._bookkeeping_sync`` reads before and in its rewind loop:
    request 0 is a partial prefill (its sample is discarded), request 1 is decoding."""
    import numpy as np

    runner = SimpleNamespace(input_batch=_StubBatch(generators),
                             discard_request_mask=SimpleNamespace(np=np.array([True, False])),
                             execute_model_state=object())

    def sample_tokens(grammar_output=None):  # vLLM's: sample (draws from each generator), bookkeep
        for g in runner.input_batch.generators.values():
            torch.rand(1, generator=g)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner._bookkeeping_sync(runner, None, None, None, None, 0)

    runner.sample_tokens = sample_tokens
    return runner


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_seeded_partial_prefill_rewind_fails_on_cpu():
    """vLLM's rewind of a discarded sample (``gen.set_offset(gen.get_offset() - 4)``) raises for
    a CPU generator: this is what kills the engine."""
    runner = _stub_runner({0: _seeded(11), 1: _seeded(12)})
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        runner.sample_tokens()


def test_seeded_partial_prefill_fixed():
    """With the fix the discarded request's seeded generator is not drawn from and not rewound;
    the decoding request's is drawn from as before; both are back in the batch afterwards."""
    g0, g1 = _seeded(11), _seeded(12)
    runner = _stub_runner({0: g0, 1: g1})
    cpu_fixes.fix_seeded_chunked_prefill(runner)
    cpu_fixes.fix_seeded_chunked_prefill(runner)  # idempotent
    with pytest.raises(_Reached):  # the rewind loop passed; the stub ends the bookkeeping there
        runner.sample_tokens()
    assert runner.input_batch.generators == {0: g0, 1: g1}
    assert torch.equal(g0.get_state(), _seeded(11).get_state())  # untouched: no draw, no rewind
    assert not torch.equal(g1.get_state(), _seeded(12).get_state())  # sampled as before
    assert torch.rand(1, generator=g0).item() == torch.rand(1, generator=_seeded(11)).item()


def test_seeded_partial_prefill_fix_is_per_runner():
    """Only the runner the fix was applied to changes; another runner keeps vLLM's behaviour."""
    fixed, other = _stub_runner({0: _seeded(11)}), _stub_runner({0: _seeded(11)})
    cpu_fixes.fix_seeded_chunked_prefill(fixed)
    assert getattr(fixed.sample_tokens, cpu_fixes._FIXED, False)
    assert not getattr(other.sample_tokens, cpu_fixes._FIXED, False)
    with pytest.raises(RuntimeError, match="does not use offset"):
        other.sample_tokens()
