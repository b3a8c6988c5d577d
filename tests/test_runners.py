"""lab.harness.runners: Model Runner V2 on this CPU is set up only when asked, and reaches child
processes (an engine's workers, ``vllm serve``) when asked.

Each check runs in a fresh interpreter: whether Triton has a ``cpu`` backend is decided once per
process, when vLLM is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = ("import triton.backends as tb, vllm.triton_utils as tu, os; "
         "print('cpu' in tb.backends, tu.HAS_TRITON, os.environ.get('VLLM_USE_V2_MODEL_RUNNER'))")


def _python(code: str, env: dict | None = None) -> list[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **(env or {})}, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_plain_plugin_import_leaves_triton_untouched():
    """A user's run: importing and registering the plugin adds no Triton backend and no runner."""
    code = "from vllm_dlite.vllm.plugin import register; register(); " + PROBE
    assert _python(code) == ["False", "False", "None"]


def test_enable_v2_on_cpu_gives_vllm_triton_and_the_v2_runner():
    code = "from lab.harness.runners import use_runner; use_runner('v2'); " + PROBE
    assert _python(code) == ["True", "True", "1"]


def test_a_child_started_with_runner_env_is_set_up_before_it_imports_anything():
    """What ``vllm serve`` and an engine's spawned workers get: the sitecustomize on PYTHONPATH."""
    from lab.harness.runners import runner_env

    assert _python(PROBE, runner_env("v2")) == ["True", "True", "1"]
    assert _python(PROBE, runner_env("v1")) == ["False", "False", "0"]


def test_enable_after_vllm_was_imported_is_refused_with_the_fix():
    code = ("import vllm.triton_utils\nfrom lab.harness.runners import enable_v2_on_cpu\n"
            "try:\n    enable_v2_on_cpu()\nexcept RuntimeError as e:\n    print('refused' if 'before vllm is imported' in str(e) else e)")
    assert _python(code) == ["refused"]


def test_unknown_runner_name():
    import pytest

    from lab.harness.runners import runner_env

    with pytest.raises(ValueError, match="use one of"):
        runner_env("v3")


def test_v2_sampler_takes_an_all_nan_logits_row_as_a_gpu_does():
    """V2's profile_run samples from the hidden states of a pass that skips attention (uninitialised
    memory, sometimes all NaN). Compiled Triton returns some token for such a row; the interpreter's
    ``np.nanargmax`` raised, so whether a V2 engine started here depended on memory. The other rows
    must still be greedy argmax."""
    code = """
from lab.harness.runners import use_runner; use_runner('v2')
import torch
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
torch.manual_seed(0)
logits = torch.randn(3, 1500)
logits[1] = float('nan')
n = logits.shape[0]
zeros = torch.zeros(n, dtype=torch.int64)
out = gumbel_sample(logits, torch.arange(n, dtype=torch.int32), torch.zeros(n), zeros, zeros,
                    apply_temperature=False, is_drafting=False)
print(out[0].item() == logits[0].argmax().item(), out[2].item() == logits[2].argmax().item(),
      0 <= out[1].item() < 1500)
"""
    assert _python(code) == ["True", "True", "True"]
