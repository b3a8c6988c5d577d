"""The project's floors: each imports only the floors before it (``lab/__init__.py`` names them).

    vllm_dlite (runtime: config, model, ops, vllm) -> vllm_dlite.train (the train extra) -> lab
    -> benchmarks / examples / tests (one floor: the tests import the benchmarks they check)

Checked on the source (every ``import`` statement, those inside functions included), so a lazy
import that would drag the lab into a serving process fails here, not in a user's environment.
The same import graph has no cycle among the repository's modules (a lazy import that closes a
circle counts: it is how circles hide). Scripts and tests import their neighbours by bare name
(``import ab``, ``from paths import REPO``): such a name is resolved as Python would find it,
in the importing script's own folder, then in ``tests/`` and ``benchmarks/`` (pytest's
``pythonpath``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from paths import REPO

RUNTIME = [REPO / "vllm_dlite" / p for p in ("__init__.py", "config.py", "model", "ops", "vllm")]
TRAIN = [REPO / "vllm_dlite" / "train"]
LAB = [REPO / "lab"]
MAX_MODULE_LINES = 650  # "no module much over 600 lines"


def modules(roots: list[Path]) -> list[Path]:
    return sorted(f for r in roots for f in ([r] if r.is_file() else r.rglob("*.py")))


def imported_names(path: Path, package: str | None = None) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (relative imports resolved against
    ``package``, by default the file's own)."""
    package = package or ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports (anywhere in its source): the
    repository graph (:func:`repo_import_graph`) of that one package."""
    return repo_import_graph(root.parent, (root.name,))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (each sorted), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


# The whole repository's modules, named by their path from the root (``benchmarks/ab.py`` is
# ``benchmarks.ab``, ``tests/paths.py`` is ``tests.paths``), and the floor each one is on.
REPO_ROOTS = ("vllm_dlite", "lab", "benchmarks", "examples", "tests")
BARE_NAME_DIRS = ("tests", "benchmarks")  # pytest.ini's pythonpath (besides the root)
FLOORS = (("vllm_dlite.train", 1), ("vllm_dlite", 0), ("lab", 2), ("benchmarks", 3), ("examples", 3),
          ("tests", 3))
FLOOR_NAMES = ("runtime (vllm_dlite)", "training (vllm_dlite.train)", "lab", "benchmarks / examples / tests")


def floor_of(module: str) -> int:
    return next(f for prefix, f in FLOORS if module == prefix or module.startswith(prefix + "."))


def repo_files(base: Path = REPO, roots: tuple[str, ...] = REPO_ROOTS) -> dict[str, Path]:
    files = {}
    for root in roots:
        for f in sorted((base / root).rglob("*.py")):
            if "results" not in f.relative_to(base).parts:
                files[module_name(f, base)] = f
    return files


def repo_import_graph(base: Path = REPO, roots: tuple[str, ...] = REPO_ROOTS) -> dict[str, set[str]]:
    """Module -> the repository modules it imports, anywhere in its source (module names as
    :func:`repo_files`). Dotted names resolve to the longest module they lie in; a name that is
    not the repository's (``import ab``) is looked up, as Python would, in the importing file's
    folder when that folder is not a package (a script's folder is on its path), then in
    :data:`BARE_NAME_DIRS`. Names that resolve to nothing are other packages'."""
    files = repo_files(base, roots)

    def longest(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    def resolve(name: str, path: Path) -> str | None:
        if name.split(".")[0] in roots:
            return longest(name)
        folders = [] if (path.parent / "__init__.py").exists() else [path.parent]
        folders += [base / d for d in BARE_NAME_DIRS if (base / d).is_dir()]
        for folder in folders:
            prefix = module_name(folder / "__init__.py", base)
            found = longest(f"{prefix}.{name}")
            if found is not None and found.startswith(prefix + "."):  # in that folder, not above it
                return found
        return None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name, path) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base_name = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base_name = ".".join(parts[: len(parts) - node.level + 1] + ([base_name] if base_name else []))
                targets.update(resolve(f"{base_name}.{a.name}", path) for a in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def describe_cycles(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    return "\n".join(" <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
                     for c in cycles)


def floor_violations(roots: list[Path], above: tuple[str, ...]) -> list[str]:
    return [f"{f.relative_to(REPO)} imports {n}" for f in modules(roots) for n in sorted(imported_names(f))
            if any(n == a or n.startswith(a + ".") for a in above)]


def test_runtime_imports_neither_training_nor_lab():
    assert floor_violations(RUNTIME, ("vllm_dlite.train", "lab")) == []


def test_training_does_not_import_the_lab():
    assert floor_violations(TRAIN, ("lab",)) == []


def test_floor_check_sees_lazy_and_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..train import data\n    import lab.harness.server\n")
    assert imported_names(probe, "vllm_dlite.vllm") == {
        "vllm_dlite.train", "vllm_dlite.train.data", "lab.harness.server"}


def test_no_import_cycle_among_vllm_dlite_modules():
    graph = import_graph(REPO / "vllm_dlite")
    cycles = import_cycles(graph)
    assert cycles == [], "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in cycles)


def test_cycle_check_sees_lazy_imports_and_submodules(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")  # lazy, a submodule
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..a import f\n")  # relative
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"}}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b"]]


@pytest.mark.parametrize("floor", range(len(FLOOR_NAMES)), ids=FLOOR_NAMES)
def test_each_floor_imports_only_the_floors_before_it(floor):
    graph = repo_import_graph()
    bad = [f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})" for m in sorted(graph)
           if floor_of(m) == floor for t in sorted(graph[m]) if floor_of(t) > floor]
    assert bad == [], "\n".join(bad)


def test_the_lab_imports_no_benchmark():
    """The lab's floor is below the benchmarks': what both need lives in the lab (``lab.buckets``)."""
    graph = repo_import_graph()
    assert {m: sorted(t for t in ts if t.startswith("benchmarks.")) for m, ts in graph.items()
            if m.startswith("lab.") and any(t.startswith("benchmarks.") for t in ts)} == {}


def test_no_import_cycle_in_the_repository():
    graph = repo_import_graph()
    cycles = import_cycles(graph)
    assert cycles == [], describe_cycles(graph, cycles)


def test_repository_graph_resolves_bare_names_of_scripts_and_tests(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "core.py").write_text("import helper\n")  # a package module: helper is tests/'s
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.py").write_text("import json\nfrom stats import mean\n")  # beside it
    (tmp_path / "pkg" / "scripts").mkdir()  # a script folder inside a package: nothing above it is found
    (tmp_path / "pkg" / "scripts" / "s.py").write_text("from __future__ import annotations\nimport pkg.core\n")
    (tmp_path / "benchmarks" / "stats.py").write_text("def mean():\n    from pkg import core\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "helper.py").write_text("import run\n")  # a benchmark, by pythonpath
    graph = repo_import_graph(tmp_path, ("pkg", "benchmarks", "tests"))
    assert graph == {"pkg": set(), "pkg.core": {"tests.helper"}, "pkg.scripts.s": {"pkg.core"},
                     "benchmarks.run": {"benchmarks.stats"},
                     "benchmarks.stats": {"pkg.core"}, "tests.helper": {"benchmarks.run"}}
    assert import_cycles(graph) == [["benchmarks.run", "benchmarks.stats", "pkg.core", "tests.helper"]]


@pytest.mark.parametrize("root", ["vllm_dlite", "lab"])
def test_no_module_much_over_600_lines(root):
    long = {str(f.relative_to(REPO)): n for f in modules([REPO / root])
            if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
