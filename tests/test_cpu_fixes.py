"""Unit tests of ``vllm_dlite.vllm.cpu_fixes``: each patch called on the inputs that break vLLM's
own function (which is shown to fail on them), and the scope (nothing is applied without a
speculative config). Fast: no engine is started. The end-to-end check is
``tests/test_sampling_matrix.py`` (slow)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from vllm_dlite.vllm import cpu_fixes, plugin  # noqa: E402


# ----------------------------------------------------------------------------- scope
def test_register_only_arranges_the_hook(monkeypatch):
    """``register()`` (through ``install()``) applies nothing: it hooks the CPU runner class."""
    def refuse(*_a, **_k):
        raise AssertionError("a fix was applied without a speculative runner")

    monkeypatch.setattr(cpu_fixes, "apply_for_runner", refuse)
    plugin.register()
    cpu_fixes.install()  # idempotent, applies nothing
    assert plugin._HOOKS[cpu_fixes.CPU_RUNNER_MODULE] is cpu_fixes.hook_cpu_runner
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
def test_expand_kernel_fix():
    """vLLM's CPU expand kernel leaves float outputs uninitialised (it writes an int64 copy); the
    fix fills them (temperature / top-p per draft token) and keeps the C++ kernel for int64."""
    import vllm._C  # noqa: F401 - the C++ kernels
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
    import vllm._C  # noqa: F401
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
