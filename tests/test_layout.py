"""The project's floors: each imports only the floors before it (``lab/__init__.py`` names them).

    vllm_dlite (runtime: config, model, ops, vllm) -> vllm_dlite.train (the train extra) -> lab

Checked on the source (every ``import`` statement, those inside functions included), so a lazy
import that would drag the lab into a serving process fails here, not in a user's environment.
The same import graph has no cycle among vllm_dlite's modules (a lazy import that closes a circle
counts: it is how circles hide).
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
    """Module -> the modules of ``root``'s package it imports (anywhere in its source). ``from p
    import m`` imports the module ``p.m`` when there is one, else ``p``; a name is resolved to the
    longest module it lies in. A package's ``__init__`` is the module ``p``."""
    files = {module_name(f, root.parent): f for f in modules([root])}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets.update(resolve(f"{base}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


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


@pytest.mark.parametrize("root", ["vllm_dlite", "lab"])
def test_no_module_much_over_600_lines(root):
    long = {str(f.relative_to(REPO)): n for f in modules([REPO / root])
            if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
