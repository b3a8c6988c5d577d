"""Every repository path the docs and the code's docstrings and comments name exists.

Where paths are looked for: the Markdown under ``docs/`` and ``lab/``, and the docstrings and
``#`` comments of every module under ``vllm_dlite/``, ``lab/`` and ``benchmarks/`` (not
``benchmarks/results/``: those are records of past runs, kept as they were written).

What counts as a path of this repository (:func:`repo_paths`): a token, backticked or plain, that
starts with one of the repository's top-level folders (:data:`TOP`) followed by ``/`` and at least
one more character, e.g. ``lab/harness/replay.py``, ``models/qwen3-tiny-stdlib`` or ``docs/``.
Not checked:

* a path with a placeholder or pattern in it: ``...``, ``<``, ``>``, ``*``, ``{``, ``}``, ``$``
  (``benchmarks/results/<name>/``, ``models/*/README.md``);
* a path qualified by something before it: a URL, ``owner/repo:path``, ``../``, ``~/``, another
  repository's or package's folder (``FlashMTP/scripts/...``, ``transformers/models/...``,
  ``vllm/v1/...``): the character before the top-level folder is one of ``/ . : ~ -`` or a word
  character;
* generated outputs: ``runs/``, ``build/``, ``data/`` are not top-level folders of the
  repository (they are git-ignored), so paths under them are never candidates.

Prose that writes ``tests/benchmarks`` for "tests and benchmarks" would be read as a path: write
"and".
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from paths import REPO

TOP = ("vllm_dlite", "lab", "benchmarks", "docs", "tests", "scripts", "configs", "models", "examples",
       "csrc", ".ci")
PLACEHOLDERS = ("...", "<", ">", "*", "{", "}", "$", "\u2026")
_CANDIDATE = re.compile(r"(?<![\w./:~-])(?:%s)/[^\s`'\"()\[\],;:|=]*" % "|".join(map(re.escape, TOP)))


def repo_paths(text: str) -> list[tuple[str, int]]:
    """``(path, offset in text)`` of every path of this repository that ``text`` names (the rule:
    this module's docstring)."""
    found = []
    for m in _CANDIDATE.finditer(text):
        path = m.group(0).rstrip(".")
        if path.rstrip("/") in TOP or any(p in path for p in PLACEHOLDERS):
            continue
        found.append((path, m.start()))
    return found


def python_texts(path: Path) -> list[tuple[int, str]]:
    """``(first line, text)`` of every docstring and ``#`` comment of a Python file."""
    source = path.read_text()
    texts = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                texts.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            texts.append((tok.start[0], tok.string))
    return texts


def python_paths(path: Path) -> list[tuple[int, str]]:
    """``(line, path)`` of every repository path named in a Python file's docstrings and comments."""
    return [(line + text[:at].count("\n"), p) for line, text in python_texts(path) for p, at in repo_paths(text)]


def markdown_files() -> list[Path]:
    return sorted(REPO.glob("docs/**/*.md")) + sorted(REPO.glob("lab/**/*.md"))


def python_files() -> list[Path]:
    return sorted(f for root in ("vllm_dlite", "lab", "benchmarks") for f in (REPO / root).rglob("*.py")
                  if not f.relative_to(REPO).parts[:2] == ("benchmarks", "results"))


def named_paths() -> list[tuple[str, str]]:
    """``(file:line, path)`` for every repository path the checked files name."""
    named = []
    for f in markdown_files():
        for i, line in enumerate(f.read_text().splitlines(), 1):
            named += [(f"{f.relative_to(REPO)}:{i}", p) for p, _ in repo_paths(line)]
    for f in python_files():
        named += [(f"{f.relative_to(REPO)}:{line}", p) for line, p in python_paths(f)]
    return named


def test_top_level_folders_exist():
    assert [t for t in TOP if not (REPO / t).is_dir()] == []


def test_every_named_repository_path_exists():
    named = named_paths()
    assert len(named) > 100  # the scan sees the docs and docstrings at all
    missing = [f"{where}: {p}" for where, p in named if not (REPO / p).exists()]
    assert missing == [], "\n".join(missing)


@pytest.mark.parametrize("text, paths", [
    ("see `lab/harness/replay.py` and docs/design.md.", ["lab/harness/replay.py", "docs/design.md"]),
    ("(``vllm_dlite/train/workloads/``: format)", ["vllm_dlite/train/workloads/"]),
    ("models/qwen3-tiny-stdlib, tests/helpers_vllm.py:80", ["models/qwen3-tiny-stdlib", "tests/helpers_vllm.py"]),
    ("writes benchmarks/results/<name>/ and models/*/README.md", []),
    ("runs/baselines/x.pt, build/vllm034/", []),
    ("vllm/v1/worker/gpu/model_runner.py, transformers/models/qwen3/modeling_qwen3.py", []),
    ("https://github.com/o/r/blob/abc/docs/TRAINING.md, FlashMTP/scripts/dlite/x.py, o/r:docs/a.md", []),
    ("../tests/a.py ~/lab/b.py my-docs/c.md", []),
    ("the `lab/` and `docs/` folders", []),
])
def test_path_detection(text, paths):
    assert [p for p, _ in repo_paths(text)] == paths


def test_docstrings_and_comments_are_read(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Module: lab/a.py."""\n\n\ndef g():\n    """In g:\n    docs/b.md"""\n'
                 '    x = "lab/not_a_docstring.py"  # comment: tests/c.py\n')
    assert sorted(python_paths(f)) == [(1, "lab/a.py"), (6, "docs/b.md"), (7, "tests/c.py")]
