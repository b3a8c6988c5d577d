"""The one seam to vLLM (``vllm_dlite.vllm.compat``) and the plugin's behaviour on other versions.

* Every private vLLM symbol the plugin hooks, wraps or subclasses exists on the pinned vLLM with
  the parameters the plugin relies on.
* On an untested vLLM (simulated in a fresh interpreter) the plugin hooks nothing: a plain vLLM
  run and an ngram run work as without the plugin; ``"method": "dlite"`` fails with one message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_dlite.vllm import compat

REPO = Path(__file__).resolve().parents[1]


def _check_in_fresh_process(prelude: str = "") -> list[str]:
    """``compat.check()`` in a fresh interpreter: it imports V2 modules that pull in numba's
    llvmlite, whose objects break vLLM's later kernel-override scan in the same process."""
    code = f"{prelude}\nimport json\nfrom vllm_dlite.vllm import compat\nprint(json.dumps(compat.check()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_private_symbols_hold_on_the_pinned_vllm():
    pytest.importorskip("vllm")
    assert compat.supported(), compat.installed_version()
    assert _check_in_fresh_process() == []


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.7", True), ("0.31.2", False),
                                         ("0.33.0", False), ("0.320.1", False), ("unknown", False)])
def test_version_series(version, ok):
    assert compat.supported(version) is ok
    if not ok:
        msg = compat.unsupported_message(version)
        assert f"vLLM {version} is installed" in msg and "0.32" in msg and "other vLLM features are unaffected" in msg


def test_check_reports_a_changed_signature():
    pytest.importorskip("vllm")
    problems = _check_in_fresh_process(
        "from vllm.v1.spec_decode import dflash\n"
        "dflash.DFlashProposer.propose = lambda self, num_speculative_tokens, something_else: None")
    assert len(problems) == 1 and "DFlashProposer.propose" in problems[0] and "expected to start with" in problems[0]


_UNTESTED = """
if __name__ == "__main__":
    import vllm
    vllm.__version__ = "0.33.0"  # an untested release
    import helpers_vllm as H
    from vllm import SamplingParams
    from vllm.v1.worker import gpu_model_runner
    from vllm.config.speculative import SpeculativeConfig
    from vllm_dlite.vllm import plugin
    init, override = gpu_model_runner.GPUModelRunner.__init__, SpeculativeConfig.__dict__["hf_config_override"]
    m = H.tiny_models()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = H.make_prompts(4)
    base = H.run_llm(m.target, prompts, sp)
    ngram = H.run_llm(m.target, prompts, sp, {{"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3}})
    assert ngram.token_ids == base.token_ids and ngram.drafter_types != ["DLiteProposer"]
    assert gpu_model_runner.GPUModelRunner.__init__ is init  # no runner hook
    assert SpeculativeConfig.__dict__["hf_config_override"] is override
    try:
        H.run_llm(m.target, prompts, sp, {{"method": "dlite", "model": str(m.drafter)}})
    except RuntimeError as exc:
        print("DLITE-ERROR:", exc)
"""


@pytest.mark.slow
def test_untested_vllm_leaves_other_runs_alone(tmp_path):
    pytest.importorskip("vllm")
    script = tmp_path / "untested.py"
    script.write_text(textwrap.dedent(_UNTESTED.format()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}  # as pytest.ini's
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("DLITE-ERROR:"))
    assert "vLLM 0.33.0 is installed: DLite is disabled" in line
    assert "vllm-dlite supports vLLM 0.32.x" in (out.stdout + out.stderr)  # the one warning
