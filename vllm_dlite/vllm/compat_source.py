"""Static check of :data:`vllm_dlite.vllm.compat.GROUPS` against a vLLM source tree (no import).

The same checks as :func:`vllm_dlite.vllm.compat.check` (symbol exists, full signature, private
attributes, protocol uses), read from the ``.py`` files of any vLLM release: the wheels' sources
fetched by ``scripts/fetch_vllm_sources.sh`` into ``.vllm-sources/<version>/``. Names are resolved
the way Python would: a module's own definitions (also inside ``if``/``try`` blocks), names it
imports from other vLLM modules, and for classes their vLLM base classes.

``python -m vllm_dlite.vllm.compat_source .vllm-sources/*`` prints which groups hold per release.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, Optional, Union

from vllm_dlite.vllm import compat

Node = Union[ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign, ast.AnnAssign]


class SourceTree:
    """The ``vllm`` package under ``root`` (``root/vllm/...``), parsed on demand."""

    def __init__(self, root: Union[str, Path]):
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"{self.root} holds no vllm/__init__.py")
        self._trees: dict[str, Optional[ast.Module]] = {}

    # ------------------------------------------------------------------ modules
    def module(self, name: str) -> Optional[ast.Module]:
        """The parsed module ``name`` (dotted, ``vllm.`` included), or None when absent."""
        if name not in self._trees:
            base = self.root.joinpath(*name.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            self._trees[name] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path else None
        return self._trees[name]

    def forget(self, path: Union[str, Path]) -> None:
        """Parse the file at ``path`` (under the tree) again when next needed (it was edited)."""
        rel = Path(path).resolve().relative_to(self.root.resolve()).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        self._trees.pop(".".join(parts), None)

    def is_package(self, name: str) -> bool:
        return (self.root.joinpath(*name.split(".")) / "__init__.py").is_file()

    @staticmethod
    def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        for stmt in body:
            yield stmt
            if isinstance(stmt, ast.If):
                yield from SourceTree._top_level(stmt.body)
                yield from SourceTree._top_level(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                    yield from SourceTree._top_level(block)

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def lookup(self, module: str, name: str, _depth: int = 0) -> Optional[tuple[str, Node]]:
        """``(module it is defined in, node)`` of the top-level ``name`` of ``module``, following
        ``from ... import`` (and submodules of a package) within vLLM; None when absent."""
        tree = self.module(module)
        if tree is None or _depth > 20:
            return None
        found = None
        for stmt in self._top_level(tree.body):  # the last definition wins, as at run time
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                found = (module, stmt)
            elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                found = (module, stmt)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                found = (module, stmt)
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = self._absolute(module, stmt)
                        if source.split(".")[0] != "vllm":
                            continue
                        hit = self.lookup(source, alias.name, _depth + 1)
                        if hit is None and self.module(f"{source}.{alias.name}") is not None:
                            hit = (f"{source}.{alias.name}", ast.Module(body=[], type_ignores=[]))  # type: ignore[assignment]
                        if hit is not None:
                            found = hit
        if found is None and self.module(f"{module}.{name}") is not None:
            return f"{module}.{name}", ast.Module(body=[], type_ignores=[])  # type: ignore[return-value]
        return found

    # ------------------------------------------------------------------ classes
    def bases(self, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        """The vLLM base classes of ``cls`` (resolved through ``module``'s names), depth first."""
        for base in cls.bases:
            if isinstance(base, ast.Subscript):  # Generic[T], Foo[Bar]
                base = base.value
            hit = None
            if isinstance(base, ast.Name):
                hit = self.lookup(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                mod = self.lookup(module, base.value.id)
                if mod is not None and isinstance(mod[1], ast.Module):
                    hit = self.lookup(mod[0], base.attr)
            if hit is not None and isinstance(hit[1], ast.ClassDef):
                yield hit  # type: ignore[misc]
                yield from self.bases(*hit)  # type: ignore[arg-type]

    def member(self, module: str, cls: ast.ClassDef, name: str) -> Optional[tuple[str, ast.stmt]]:
        """A method / class attribute ``name`` of ``cls`` or of its vLLM bases."""
        for mod, klass in [(module, cls), *self.bases(module, cls)]:
            hit = None
            for stmt in klass.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                    hit = (mod, stmt)
                elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                          for t in stmt.targets):
                    hit = (mod, stmt)
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                        and stmt.target.id == name:
                    hit = (mod, stmt)
            if hit is not None:
                return hit
        return None

    def class_names(self, module: str, cls: ast.ClassDef) -> set[str]:
        names: set[str] = set()
        for _, klass in [(module, cls), *self.bases(module, cls)]:
            names |= compat.class_body_names(klass)
        return names

    def resolve(self, module: str, path: str) -> tuple[Optional[tuple[str, ast.AST]], Optional[tuple[str, ast.AST]]]:
        """``(owner, target)`` of ``vllm.<module>.<path>``: each ``(defining module, node)`` or None."""
        owner: Optional[tuple[str, ast.AST]] = None
        hit: Optional[tuple[str, ast.AST]] = (f"vllm.{module}", self.module(f"vllm.{module}"))  # type: ignore[assignment]
        if hit[1] is None:
            return None, None
        for part in path.split("."):
            owner, node = hit, hit[1]
            if isinstance(node, ast.Module):
                hit = self.lookup(hit[0], part)  # type: ignore[assignment]
            elif isinstance(node, ast.ClassDef):
                hit = self.member(hit[0], node, part)  # type: ignore[assignment]
            else:
                hit = None
            if hit is None:
                return owner, None
        return owner, hit


def check_need(tree: SourceTree, need: compat.Need) -> list[str]:
    """:func:`vllm_dlite.vllm.compat.check_need`, read from ``tree`` (external needs: not checked;
    an ``optional`` need whose module the tree lacks: no problem)."""
    if need.external:
        return []
    owner, hit = tree.resolve(need.module, need.path)
    if owner is None and need.optional:
        return []  # a release before the module: the adapter's older path
    if hit is None:
        where = "module absent" if owner is None else "not defined"
        return [f"{need.name}: {where}"]
    module, node = hit
    problems = []
    if need.signatures:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems.append(f"{need.name}: not a function")
        else:
            problem = compat.signature_problem(need, compat.format_ast_signature(node.args))
            if problem:
                problems.append(problem)
    if need.attrs:
        cls = node if isinstance(node, ast.ClassDef) else (owner[1] if owner else None)
        cls_module = module if isinstance(node, ast.ClassDef) else (owner[0] if owner else module)
        have = tree.class_names(cls_module, cls) if isinstance(cls, ast.ClassDef) else set()
        if isinstance(cls, ast.Module):
            have = {n for n in need.attrs if tree.lookup(cls_module, n) is not None}
        missing = [a for a in need.attrs if a not in have]
        if missing:
            problems.append(f"{need.name}: no attribute {', '.join(missing)}")
    if need.uses:
        missing = compat.mentions(node, need.uses)
        if missing:
            problems.append(f"{need.name}: does not use {', '.join(missing)}")
    return problems


def check_tree(root: Union[str, Path, SourceTree]) -> dict[str, list[str]]:
    """``{group name: problems}`` for the vLLM source tree at ``root`` (empty list: the group holds)."""
    tree = root if isinstance(root, SourceTree) else SourceTree(root)
    return {g.name: [p for n in g.needs for p in check_need(tree, n)] for g in compat.GROUPS}


def holding_groups(root: Union[str, Path, SourceTree]) -> frozenset[str]:
    return frozenset(name for name, problems in check_tree(root).items() if not problems)


def main(argv: Optional[list[str]] = None) -> int:
    roots = argv if argv is not None else sys.argv[1:]
    if not roots:
        print("usage: python -m vllm_dlite.vllm.compat_source SOURCE_ROOT...  (scripts/fetch_vllm_sources.sh)")
        return 2
    for root in roots:
        print(f"== {root}")
        for name, problems in check_tree(root).items():
            print(f"  {name:18s} {'holds' if not problems else f'{len(problems)} problem(s)'}")
            for p in problems:
                print(f"      {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
