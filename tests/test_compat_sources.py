"""compat's groups checked statically against each vLLM release's own sources (no import).

* Which groups hold on each release is what ``compat.KNOWN_GROUPS`` records (0.34 has no Model
  Runner V1: its V1 proposer, adaptive hooks and CPU fixes have nothing to attach to).
* The check is not vacuous: in a copy of each release's tree, renaming one function, one private
  attribute, one protocol name or one parameter the plugin relies on makes exactly the group that
  needs it fail, naming the symbol.

Sources: ``bash scripts/fetch_vllm_sources.sh`` (skipped, naming that command, when absent).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from vllm_dlite.vllm import compat
from vllm_dlite.vllm.compat_source import SourceTree, check_tree
from vllm_sources import VERSIONS, source_root


@pytest.mark.parametrize("version", VERSIONS)
def test_groups_hold_as_recorded(version):
    problems = check_tree(source_root(version))
    holding = {name for name, p in problems.items() if not p}
    assert holding == set(compat.KNOWN_GROUPS[version]), problems


def test_every_supported_series_has_a_record():
    for series in compat.SUPPORTED_VLLM_SERIES:
        recorded = [v for v in compat.KNOWN_GROUPS if compat.series_of(v) == series]
        assert recorded, f"vLLM {series} is supported but KNOWN_GROUPS has no release of it"
        for v in recorded:  # a supported series hooks something: the core holds there
            assert "core" in compat.KNOWN_GROUPS[v]


def _rename_first_after(anchor: str, old: str, new: str):
    def mutate(text: str) -> str:
        i = text.index(old, text.index(anchor) + len(anchor))
        return text[:i] + new + text[i + len(old):]
    return mutate


def _rename_all(old: str, new: str):
    def mutate(text: str) -> str:
        assert re.search(re.escape(old), text), old
        return text.replace(old, new)
    return mutate


# (what, file under vllm/, mutation, group that must fail, text the problem names, versions)
MUTATIONS = [
    ("function", "engine/arg_utils.py", _rename_all("def create_speculative_config(", "def create_spec_config("),
     "core", "EngineArgs.create_speculative_config: not defined", VERSIONS),
    ("parameter", "config/speculative.py", _rename_first_after("def hf_config_override(", "hf_config", "draft_config"),
     "core", "SpeculativeConfig.hf_config_override: signature (draft_config", VERSIONS),
    ("private attribute", "model_executor/layers/vocab_parallel_embedding.py",
     _rename_all("get_sharded_to_full_mapping", "get_full_mapping"), "core",
     "no attribute get_sharded_to_full_mapping", VERSIONS),
    ("private attribute", "v1/spec_decode/llm_base_proposer.py", _rename_all("_last_draft_probs", "_draft_probs"),
     "v1 runner", "no attribute _last_draft_probs", ("0.32.0", "0.33.0")),
    ("protocol", "v1/worker/gpu_model_runner.py", _rename_all("take_last_draft_probs", "take_draft_probs"),
     "v1 runner", "does not use take_last_draft_probs", ("0.32.0", "0.33.0")),
    ("private attribute", "v1/worker/gpu_input_batch.py", _rename_all("self.token_ids_cpu =", "self.token_ids ="),
     "v1 runner", "no attribute token_ids_cpu", ("0.32.0", "0.33.0")),
    ("private attribute", "v1/worker/gpu/spec_decode/speculator.py",
     _rename_all("num_speculative_steps", "num_steps"), "v2 runner", "no attribute num_speculative_steps",
     ("0.32.0", "0.33.0")),
    ("parameter", "v1/worker/gpu/spec_decode/__init__.py", _rename_all("req_states", "request_states"),
     "v2 runner", "init_speculator: signature", ("0.32.0", "0.33.0")),
    ("module attribute", "triton_utils/dispatcher.py", _rename_all("_registry", "_kernels"),
     "cpu fixes", "dispatcher._registry: not defined", ("0.32.0", "0.33.0")),
    ("function", "v1/worker/gpu/spec_decode/speculator_config.py",
     _rename_all("def register_speculative_method(", "def register_method("), "v2 registry",
     "register_speculative_method: not defined", ("0.34.0",)),
    ("protocol", "v1/worker/gpu/spec_decode/__init__.py", _rename_all("speculator_class", "impl_class"),
     "v2 registry", "does not use speculator_class", ("0.34.0",)),
]
CASES = [pytest.param(version, *m[1:5], id=f"{version}-{m[3]}-{m[0]}-{i}")
         for i, m in enumerate(MUTATIONS) for version in m[5]]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """One copy of each release's tree (and its parsed modules, and the groups that hold on it)."""
    made: dict[str, tuple[SourceTree, dict]] = {}

    def copy(version: str) -> tuple[SourceTree, dict]:
        if version not in made:
            dest = tmp_path_factory.mktemp(f"vllm-{version}")
            shutil.copytree(source_root(version) / "vllm", dest / "vllm")
            tree = SourceTree(dest)
            made[version] = (tree, check_tree(tree))
        return made[version]
    return copy


@pytest.mark.parametrize("version, path, mutate, group, named", CASES)
def test_a_renamed_symbol_fails_its_group(copies, version, path, mutate, group, named):
    tree, before = copies(version)
    assert before[group] == [], before[group]
    file = tree.root / "vllm" / path
    original = file.read_text()
    try:
        file.write_text(mutate(original))
        tree.forget(file)
        after = check_tree(tree)
    finally:
        file.write_text(original)
        tree.forget(file)
    assert after[group], f"renaming in {path} went unnoticed by {group!r}"
    assert any(named in p for p in after[group]), after[group]
    # nothing else became unavailable
    assert {g for g, p in after.items() if p} - {g for g, p in before.items() if p} == {group}


def test_the_0_34_registry_adapter_fits_0_34():
    """``registry_v034`` (not importable here: it imports 0.34's config modules) read as source:
    what it imports exists in 0.34, and every name its config class sets or overrides is one that
    0.34's DFlashSpeculatorConfig (or its bases) declares, so nothing it sets is silently ignored."""
    import ast

    import vllm_dlite.vllm

    tree = SourceTree(source_root("0.34.0"))
    module = ast.parse(Path(vllm_dlite.vllm.__file__).with_name("registry_v034.py").read_text())
    imports = [(n.module, a.name) for n in ast.walk(module) if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("vllm.") for a in n.names]
    assert imports, "registry_v034 imports nothing from vLLM?"
    for mod, name in imports:
        assert tree.lookup(mod, name) is not None, f"{mod}.{name} is not in vLLM 0.34"
    ours = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "DLiteSpeculatorConfig")
    base_module, base = tree.lookup("vllm.v1.worker.gpu.spec_decode.dflash.config", "DFlashSpeculatorConfig")
    declared = tree.class_names(base_module, base)
    overridden = {n.name for n in ours.body if isinstance(n, ast.FunctionDef)} | {
        t.id for n in ours.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert overridden and overridden <= declared, sorted(overridden - declared)
