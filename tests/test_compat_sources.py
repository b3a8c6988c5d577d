"""compat's groups checked statically against each vLLM release's own sources (no import).

* Which groups hold on each release is what ``compat.KNOWN_GROUPS`` records (0.34 has no Model
  Runner V1: its V1 proposer and CPU fixes have nothing to attach to).
* The check is not vacuous: in a copy of each release's tree, renaming one function, one private
  attribute, one protocol name or one parameter the plugin relies on makes exactly the group that
  needs it fail, naming the symbol.
* The V2 speculator's adapters fit each release: ``compat.graph_manager_decode_query`` binds the
  real ``CudaGraphManager.__init__`` parameters of each, and ``DLiteSpeculator`` keeps each base's
  method signatures, defines its abstract methods and assigns none of its read-only properties.

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


def _rename_parameter(old: str, new: str):
    """The first parameter line ``    old: ...`` / ``    old,`` of the file (its first definition)."""
    def mutate(text: str) -> str:
        out, n = re.subn(rf"(?m)^(\s+){re.escape(old)}(\s*[:,=)])", rf"\g<1>{new}\g<2>", text, count=1)
        assert n == 1, old
        return out
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
     VERSIONS),
    ("parameter", "v1/worker/gpu/cudagraph_utils.py", _rename_parameter("decode_query_len", "decode_query_size"),
     "v2 runner", "CudaGraphManager.__init__: signature (self, vllm_config, device, cudagraph_mode, decode_query_size",
     ("0.32.0", "0.33.0")),
    ("parameter", "v1/worker/gpu/cudagraph_utils.py", _rename_parameter("decode_query_lens", "decode_query_sizes"),
     "v2 runner", "CudaGraphManager.__init__: signature (self, vllm_config, device, cudagraph_mode, decode_query_sizes",
     ("0.34.0",)),
    ("private attribute", "v1/worker/gpu/spec_decode/draft_logits.py", _rename_all("self.values =", "self.logits ="),
     "v2 runner", "DraftLogitsCache: no attribute values", ("0.34.0",)),
    ("class", "v1/worker/gpu/spec_decode/draft_logits.py",
     _rename_all("class DraftLogitsCache:", "class DraftLogitCache:"), "v2 runner", "DraftLogitsCache: not defined",
     ("0.34.0",)),
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


def _speculator_v2_module():
    import ast

    import vllm_dlite.vllm

    return ast.parse(Path(vllm_dlite.vllm.__file__).with_name("speculator_v2.py").read_text())


def _manager_class_from_source(version: str):
    """A stand-in class whose ``__init__`` has exactly the parameters of ``version``'s
    ``CudaGraphManager.__init__`` (annotations dropped, defaults None), read from its source."""
    import ast

    tree = SourceTree(source_root(version))
    _, hit = tree.resolve("v1.worker.gpu.cudagraph_utils", "CudaGraphManager.__init__")
    args = hit[1].args
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    params = ast.unparse(args)
    namespace: dict = {}
    exec(f"class CudaGraphManager:\n    def __init__({params}):\n        self.bound = dict(locals())\n",  # noqa: S102
         namespace)
    return namespace["CudaGraphManager"]


@pytest.mark.parametrize("version", VERSIONS)
def test_graph_manager_adapter_binds_each_release_signature(version):
    """compat.graph_manager_decode_query against each release's real CudaGraphManager.__init__
    parameters: the keyword it picks binds, with the value that release expects."""
    cls = _manager_class_from_source(version)
    kwargs = compat.graph_manager_decode_query(cls, query_len=1, max_num_reqs=8)
    bound = cls("vllm_config", "device", "cudagraph_mode", **kwargs).bound
    if version == "0.34.0":
        assert bound["decode_query_lens"] == {1: 8}
    else:
        assert bound["decode_query_len"] == 1


def _is_abstract(node) -> bool:
    import ast

    return any((isinstance(d, ast.Name) and d.id == "abstractmethod")
               or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod") for d in node.decorator_list)


def _is_read_only_property(klass, name: str) -> bool:
    import ast

    decorated = [d for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name for d in n.decorator_list]
    is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in decorated)
    has_setter = any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in decorated)
    return is_property and not has_setter


@pytest.mark.parametrize("version", VERSIONS)
def test_dlite_speculator_fits_each_release_base(version):
    """DLiteSpeculator (read as source) against each release's DraftModelSpeculator and its bases:
    every method it overrides keeps the base's full signature (``__init__`` excepted: it adds
    ``req_states=``), it defines every abstract method, and no attribute it assigns is a read-only
    property there (0.34 made ``max_model_len`` one)."""
    import ast

    ours = next(n for n in _speculator_v2_module().body if isinstance(n, ast.ClassDef) and n.name == "DLiteSpeculator")
    methods = {n.name: n for n in ours.body if isinstance(n, ast.FunctionDef)}
    assigned = {t.attr for n in ast.walk(ours) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert {"draft_attn_layer_names", "features", "graphs"} <= assigned

    tree = SourceTree(source_root(version))
    module, base = tree.lookup("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator")
    chain = [base, *(k for _, k in tree.bases(module, base))]
    overridden = [name for name in methods if name != "__init__" and tree.member(module, base, name) is not None]
    assert {"propose", "set_attn", "load_draft_model", "init_cudagraph_manager", "capture"} <= set(overridden)
    for name in overridden:
        _, theirs = tree.member(module, base, name)
        assert compat.format_ast_signature(methods[name].args) == compat.format_ast_signature(theirs.args), name
    abstract = {n.name for k in chain for n in k.body if isinstance(n, ast.FunctionDef) and _is_abstract(n)}
    assert abstract and abstract <= set(methods), sorted(abstract - set(methods))
    read_only = sorted(a for a in assigned if any(_is_read_only_property(k, a) for k in chain))
    assert read_only == [], f"DLiteSpeculator assigns read-only properties of vLLM {version}'s base: {read_only}"
