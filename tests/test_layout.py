"""The project's floors: each imports only the floors before it (``lab/__init__.py`` names them).

    vllm_dlite (runtime: config, model, ops, vllm) -> vllm_dlite.train (the train extra) -> lab

Checked on the source (every ``import`` statement, those inside functions included), so a lazy
import that would drag the lab into a serving process fails here, not in a user's environment.
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


@pytest.mark.parametrize("root", ["vllm_dlite", "lab"])
def test_no_module_much_over_600_lines(root):
    long = {str(f.relative_to(REPO)): n for f in modules([REPO / root])
            if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
