"""Deterministic workload generator over the running interpreter's standard library.

Contract: ``generate(kind, split, n, seed)`` returns the same sessions for the same arguments on
the same interpreter (the stdlib ``Lib/`` tree is the "repository" the agent works on).
Sessions follow docs/design.md §6 (see ``schema.py``). Train and held-out splits are disjoint
*by source file*: a file belongs to ``heldout`` when a stable hash of its path says so.

Kinds:
* ``agentic``: a scripted agent investigates and edits one stdlib module with the canonical
  tools ``list_dir``, ``read_file``, ``grep``, ``run``, ``edit_file``. Tool results are real: the
  file listing, file contents, grep output over the tree, and the output of real commands
  (``wc``, ``python3 -c ...``) run in a scratch copy that carries the session's edits. Sessions
  have >= 10 assistant turns; contexts grow from ~1k tokens to >= ~9k (60% of sessions), ~18-22k
  (about 20%) or ~22-29k tokens (about 20%: long agent sessions fill a 32k window); assistant
  turns are short.
* ``code``: complete a function body given the preceding source of its file: 30-80 lines, or with
  ``context="file"`` everything before the body (``heldout_code_long_file.jsonl``: replies that are
  not copies of a prompt of up to ~28k tokens; the length class is a stable hash of the id, so prompts
  spread over ``FILE_CONTEXT_CHARS``). With ``context="docstring"`` the prompt is a whole file from
  which one function's docstring was removed and the reply is that docstring's first paragraph
  (``heldout_code_docstring.jsonl``: a question about a long file whose answer is prose, not in it).
* ``chat``: short one- or two-turn questions answered from stdlib docstrings.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 12
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3",
                 "__pycache__", "ensurepip", "tkinter", "venv", "config-3.11-x86_64-linux-gnu"}
# Modules whose import has side effects we never want (they are still readable as text).
READ_ONLY_FILES = {"antigravity.py", "this.py", "__phello__"}

SYSTEM_PROMPT = ("You are a coding agent working in the Python standard library source tree. "
                 "Use the tools to inspect files, run commands and make edits. Keep replies short.")


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


AGENT_TOOLS = [
    _tool("list_dir", "List the entries of a directory.",
          {"path": {"type": "string"}}, ["path"]),
    _tool("read_file", "Read lines start..end (1-based, inclusive) of a file.",
          {"path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}},
          ["path", "start", "end"]),
    _tool("grep", "Search a regular expression in a file or directory tree.",
          {"pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern", "path"]),
    _tool("run", "Run a shell command in the repository root and return its output.",
          {"cmd": {"type": "string"}}, ["cmd"]),
    _tool("edit_file", "Replace the exact text old with new in a file.",
          {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
          ["path", "old", "new"]),
]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    digest = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16)
    return "heldout" if digest % 100 < HELDOUT_PERCENT else "train"


@lru_cache(maxsize=None)
def stdlib_files() -> tuple[str, ...]:
    """Relative paths of the stdlib's own .py files (no tests, no site-packages), sorted."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                out.append(str((Path(dirpath) / fn).relative_to(root)))
    return tuple(sorted(out))


@lru_cache(maxsize=4096)
def read_text(relpath: str) -> str:
    return (stdlib_root() / relpath).read_text(encoding="utf-8", errors="replace")


@dataclass
class FunctionInfo:
    path: str
    name: str
    qualname: str
    lineno: int          # 1-based line of ``def``
    end_lineno: int
    body_lineno: int     # first line of the body after the docstring
    docstring: str | None
    docstring_lines: tuple[int, int] | None = None  # 1-based first and last line of the docstring


def functions_of(relpath: str) -> list[FunctionInfo]:
    try:
        tree = ast.parse(read_text(relpath))
    except (SyntaxError, ValueError):
        return []
    out: list[FunctionInfo] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child)
                body = child.body[1:] if doc is not None and len(child.body) > 1 else child.body
                doc_node = child.body[0] if doc is not None else None
                out.append(FunctionInfo(relpath, child.name, prefix + child.name, child.lineno,
                                        child.end_lineno or child.lineno, body[0].lineno, doc,
                                        (doc_node.lineno, doc_node.end_lineno) if doc_node else None))
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return out


def files_of_split(split: str) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [p for p in stdlib_files() if split_of(p) == split]


# --------------------------------------------------------------------------------------------
# The agent's sandbox: real tool results over the stdlib tree plus the session's own edits.
# --------------------------------------------------------------------------------------------

class Workspace:
    """Read-only view of the stdlib tree with a per-session overlay of edited files."""

    def __init__(self) -> None:
        self.root = stdlib_root()
        self.overlay: dict[str, str] = {}

    def text(self, path: str) -> str:
        return self.overlay.get(path) or read_text(path)

    def list_dir(self, path: str) -> str:
        d = self.root / path
        if not d.is_dir():
            return f"error: {path} is not a directory"
        entries = []
        for e in sorted(d.iterdir()):
            if e.name in EXCLUDED_DIRS or e.name.startswith("."):
                continue
            entries.append(e.name + ("/" if e.is_dir() else ""))
        return "\n".join(entries)

    def read_file(self, path: str, start: int, end: int) -> str:
        lines = self.text(path).splitlines()
        start, end = max(1, start), min(len(lines), end)
        return "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(start, end + 1))

    def grep(self, pattern: str, path: str, max_hits: int = 40) -> str:
        rx = re.compile(pattern)
        target = self.root / path
        paths = ([path] if target.is_file() else
                 [p for p in stdlib_files() if p.startswith(path.rstrip("/") + "/") or path in ("", ".")])
        hits = []
        for p in paths:
            for i, line in enumerate(self.text(p).splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{p}:{i}:{line.strip()[:120]}")
                    if len(hits) >= max_hits:
                        return "\n".join(hits) + f"\n... (stopped after {max_hits} matches)"
        return "\n".join(hits) if hits else "(no matches)"

    def edit_file(self, path: str, old: str, new: str) -> str:
        text = self.text(path)
        count = text.count(old)
        if count != 1:
            return f"error: old text found {count} times in {path}; it must match exactly once"
        line = text[: text.index(old)].count("\n") + 1
        self.overlay[path] = text.replace(old, new, 1)
        return f"Edited {path}: replaced 1 occurrence at line {line} (+{new.count(chr(10)) - old.count(chr(10))} lines)."

    def run(self, cmd: str, files: list[str]) -> str:
        """Run ``cmd`` for real in a scratch copy of ``files`` (with this session's edits)."""
        with tempfile.TemporaryDirectory(prefix="dlite-ws-") as tmp:
            for p in files:
                dst = Path(tmp) / p
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(self.text(p), encoding="utf-8")
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
            proc = subprocess.run(["bash", "-c", cmd], cwd=tmp, env=env, capture_output=True,
                                  text=True, timeout=60)
            out = (proc.stdout + proc.stderr).replace(tmp, ".").strip()
            return (out or "(no output)") + ("" if proc.returncode == 0 else f"\n[exit {proc.returncode}]")


# --------------------------------------------------------------------------------------------
# Session builders.
# --------------------------------------------------------------------------------------------

class SessionBuilder:
    def __init__(self, sid: str, kind: str, tools: list[dict]) -> None:
        self.sid, self.kind, self.tools = sid, kind, tools
        self.messages: list[dict] = []
        self.n_calls = 0

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def call(self, thought: str, name: str, args: dict, result: str) -> str:
        call_id = f"call_{self.n_calls}"
        self.n_calls += 1
        self.messages.append({"role": "assistant", "content": thought, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        return result

    def session(self) -> dict:
        return {"id": self.sid, "kind": self.kind, "tools": self.tools, "messages": self.messages}


def _python_cmd(code: str) -> str:
    return f"python3 -c {json.dumps(code)}"


TASKS = [
    "Find where `{name}` is defined in `{pkg}` and explain what it returns. Add a short comment above it.",
    "A user reports that `{name}` in `{path}` behaves unexpectedly. Investigate and document its edge cases.",
    "Review `{name}` in `{path}`: check its callers and add a docstring note about its arguments.",
    "Trace how `{name}` is used across `{pkg}` and leave a TODO comment where it is defined.",
]


MIN_AGENTIC_CHARS = 36_000  # ~9k tokens of this tokenizer on stdlib code
# Context a session reads up to, in multiples of MIN_AGENTIC_CHARS: short / long / longest. The
# longest stay under ~30k tokens so that every turn fits the tiny target's 32k window.
LENGTH_CLASSES = (1.0, 2.0, 2.5)


def _length_class(sid: str, long: bool) -> float:
    """Rng-free (a stable hash of the id), so the sessions' random choices stay as they were."""
    if not long:
        return LENGTH_CLASSES[0]
    return LENGTH_CLASSES[1 + int(hashlib.sha256(sid.encode()).hexdigest(), 16) % 2]


def _context_chars(messages: list[dict]) -> int:
    return sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or [])) for m in messages)


def _chunks(start: int, end: int, size: int):
    for s in range(start, end + 1, size):
        yield s, min(end, s + size - 1)


def agentic_session(rng: random.Random, sid: str, path: str, long: bool) -> dict | None:
    ws = Workspace()
    funcs = [f for f in functions_of(path) if not f.name.startswith("__") and f.end_lineno - f.lineno >= 3]
    lines = read_text(path).splitlines()
    if not funcs or len(lines) < 150:
        return None
    fn = rng.choice(funcs)
    pkg = str(Path(path).parent) if "/" in path else "."
    sb = SessionBuilder(sid, "agentic", AGENT_TOOLS)
    sb.add("system", SYSTEM_PROMPT)
    sb.add("user", rng.choice(TASKS).format(name=fn.name, pkg=pkg, path=path))

    sb.call(f"I'll start by listing `{pkg}`.", "list_dir", {"path": pkg}, ws.list_dir(pkg))
    sb.call(f"Let me search for the definition of `{fn.name}`.", "grep",
            {"pattern": rf"def {fn.name}\b", "path": pkg}, ws.grep(rf"def {fn.name}\b", pkg))
    sb.call("Let me check the size of the file.", "run", {"cmd": f"wc -l {path}"},
            ws.run(f"wc -l {path}", [path]))
    window = rng.choice([80, 120, 160])
    start = max(1, fn.lineno - 10)
    sb.call(f"Reading `{fn.name}` around line {fn.lineno}.", "read_file",
            {"path": path, "start": start, "end": start + window - 1},
            ws.read_file(path, start, start + window - 1))
    # Read the module from the top, as an agent does to understand imports and helpers.
    n_reads = rng.randint(8, 12) if long else rng.randint(3, 5)
    for k, (a, b) in enumerate(_chunks(1, len(lines), window)):
        if k >= n_reads:
            break
        sb.call(rng.choice(["Reading more of the file.", f"Continuing with lines {a}-{b}.",
                            "Let me read the next part."]), "read_file",
                {"path": path, "start": a, "end": b}, ws.read_file(path, a, b))
    sb.call(f"Now the callers of `{fn.name}`.", "grep",
            {"pattern": rf"\b{fn.name}\(", "path": pkg}, ws.grep(rf"\b{fn.name}\(", pkg))
    others = [p for p in stdlib_files() if p != path and p.startswith(pkg + "/")] if pkg != "." else []
    if others:
        other = rng.choice(others)
        n_other = len(read_text(other).splitlines())
        reads = 3 if long else 1
        for a, b in list(_chunks(1, n_other, window))[:reads]:
            sb.call(f"Checking `{other}` for context.", "read_file",
                    {"path": other, "start": a, "end": b}, ws.read_file(other, a, b))
    # Keep reading until the context is long (LENGTH_CLASSES): agent contexts grow with every tool
    # result. Deterministic and rng-free, so the sessions' random choices are unchanged.
    extra = [(path, a, b) for a, b in list(_chunks(1, len(lines), window))[n_reads:]]
    if others:
        extra += [(other, a, b) for a, b in list(_chunks(1, n_other, window))[reads:]]
    # Then the module's neighbours in its directory, in name order.
    siblings = [p for p in stdlib_files() if str(Path(p).parent) == str(Path(path).parent) and p != path]
    start_at = sum(p < path for p in siblings)
    for p in siblings[start_at:] + siblings[:start_at]:
        extra += [(p, a, b) for a, b in list(_chunks(1, len(read_text(p).splitlines()), window))[:2]]
    min_chars = _length_class(sid, long) * MIN_AGENTIC_CHARS
    while extra and _context_chars(sb.messages) < min_chars:
        p, a, b = extra.pop(0)
        sb.call(f"Reading `{p}` lines {a}-{b}.", "read_file", {"path": p, "start": a, "end": b},
                ws.read_file(p, a, b))
    count_cmd = _python_cmd(f"import ast; t = ast.parse(open({path!r}).read()); "
                            "print(sum(isinstance(n, ast.FunctionDef) for n in ast.walk(t)), 'functions')")
    sb.call("Counting the functions in the module.", "run", {"cmd": count_cmd}, ws.run(count_cmd, [path]))
    def_line = lines[fn.lineno - 1]
    indent = def_line[: len(def_line) - len(def_line.lstrip())]
    note = rng.choice(["TODO: document edge cases", "NOTE: see callers before changing",
                       "Reviewed: returns early on empty input"])
    new = f"{indent}# {note}\n{def_line}"
    sb.call(f"Adding a comment above `{fn.name}`.", "edit_file",
            {"path": path, "old": def_line, "new": new}, ws.edit_file(path, def_line, new))
    a = max(1, fn.lineno - 2)
    sb.call("Verifying the edit.", "read_file", {"path": path, "start": a, "end": a + 12},
            ws.read_file(path, a, a + 12))
    check = _python_cmd(f"import ast; ast.parse(open({path!r}).read()); print('syntax ok')")
    sb.call("Checking that the file still parses.", "run", {"cmd": check}, ws.run(check, [path]))
    sb.add("assistant", f"Done. `{fn.qualname}` is defined in `{path}` at line {fn.lineno}. "
                        f"I added a comment (`{note}`) above it and the file still parses.")
    return sb.session()


# Characters of source before the body for ``context="file"``: ~0.5-2k, 2-8k and 8-28k tokens
# (~4.5 characters a token on stdlib code), so that the prompts cover every bucket of benchmarks/ab.py.
FILE_CONTEXT_CHARS = ((2_500, 9_000), (9_000, 36_000), (36_000, 125_000))


def file_context_chars(sid: str) -> tuple[int, int]:
    """The whole-file length class of a session id (a stable hash, so prompts spread over the classes)."""
    return FILE_CONTEXT_CHARS[int(hashlib.sha256(sid.encode()).hexdigest(), 16) % 3]


def one_turn_code_session(sid: str, prompt: str, reply: str) -> dict:
    sb = SessionBuilder(sid, "code", [])
    sb.add("user", prompt)
    sb.add("assistant", reply)
    return sb.session()


def code_session(rng: random.Random, sid: str, path: str, context: str = "lines") -> dict | None:
    funcs = [f for f in functions_of(path) if 3 <= f.end_lineno - f.body_lineno + 1 <= 30]
    lines = read_text(path).splitlines()
    if context == "file":  # keep the functions whose preceding source falls in this id's class
        lo, hi = file_context_chars(sid)
        funcs = [f for f in funcs if lo <= len("\n".join(lines[: f.body_lineno - 1])) < hi]
    if not funcs:
        return None
    fn = rng.choice(funcs)
    first = 0 if context == "file" else max(0, fn.body_lineno - 1 - rng.randint(30, 80))
    context_src = "\n".join(lines[first: fn.body_lineno - 1])
    body = "\n".join(lines[fn.body_lineno - 1: fn.end_lineno])
    prompt = (f"Complete the body of `{fn.qualname}` in `{path}`. Reply with the body only.\n\n"
              f"```python\n{context_src}\n```")
    return one_turn_code_session(sid, prompt, f"```python\n{body}\n```")


def first_paragraph(docstring: str) -> str:
    return " ".join(docstring.strip().split("\n\n")[0].split())


def docstring_session(rng: random.Random, sid: str, path: str) -> dict | None:
    """``context="docstring"``: the whole file without one function's docstring; the reply writes
    the first paragraph of it back (40-400 characters of prose, none of it left in the prompt)."""
    lines = read_text(path).splitlines()

    def without_docstring(f: FunctionInfo) -> str:
        return "\n".join(lines[: f.docstring_lines[0] - 1] + lines[f.docstring_lines[1]:])

    lo, hi = file_context_chars(sid)
    funcs = [f for f in functions_of(path) if f.docstring_lines and f.body_lineno > f.docstring_lines[1]
             and 40 <= len(first_paragraph(f.docstring)) <= 400 and '"""' not in f.docstring
             and "\\" not in f.docstring and lo <= len(without_docstring(f)) < hi]
    if not funcs:
        return None
    fn = rng.choice(funcs)
    answer = first_paragraph(fn.docstring)
    source = without_docstring(fn)
    if answer in " ".join(source.split()) or answer.endswith('"'):  # elsewhere in the file: a copy
        return None
    prompt = (f"The docstring of `{fn.qualname}` was removed from `{path}` below. Write the first "
              f"paragraph of it. Reply with the docstring only.\n\n```python\n{source}\n```")
    return one_turn_code_session(sid, prompt, f'```python\n"""{answer}"""\n```')


def chat_session(rng: random.Random, sid: str, path: str) -> dict | None:
    funcs = [f for f in functions_of(path) if f.docstring and 20 <= len(f.docstring) <= 600]
    if not funcs:
        return None
    fn = rng.choice(funcs)
    module = path[:-3].replace("/", ".").removesuffix(".__init__")
    sb = SessionBuilder(sid, "chat", [])
    sb.add("user", rng.choice(["What does `{m}.{f}` do?", "Briefly explain `{f}` from the `{m}` module.",
                               "In Python's `{m}`, what is `{f}` for?"]).format(m=module, f=fn.qualname))
    sb.add("assistant", first_paragraph(fn.docstring))
    if rng.random() < 0.5:
        lines = read_text(path).splitlines()
        sig = lines[fn.lineno - 1].strip()
        sb.add("user", "What is its signature?")
        sb.add("assistant", f"It is defined in `{path}` as:\n```python\n{sig}\n```")
    return sb.session()


BUILDERS = {"agentic": agentic_session, "code": code_session, "chat": chat_session}


CODE_CONTEXTS = ("lines", "file", "docstring")


def check_workload(kind: str, context: str = "lines") -> None:
    if kind not in BUILDERS:
        raise ValueError(f"kind must be one of {sorted(BUILDERS)}, got {kind!r}")
    if context not in CODE_CONTEXTS or (context != "lines" and kind != "code"):
        raise ValueError(f"context must be one of {CODE_CONTEXTS} and is for kind 'code' only, "
                         f"got kind {kind!r}, context {context!r}")


def split_name(name: str) -> tuple[str, str]:
    """A training-data name, ``kind`` or ``kind:context`` (``code:docstring``), as (kind, context)."""
    kind, _, context = name.partition(":")
    check_workload(kind, context or "lines")
    return kind, context or "lines"


def generate(kind: str, split: str, n: int, seed: int = 0, context: str = "lines") -> list[dict]:
    """Return ``n`` sessions of ``kind`` drawn from files of ``split`` (deterministic);
    ``context`` (code only): "lines" (30-80 lines before the body), "file" (all of them) or
    "docstring" (the whole file, write a removed docstring back)."""
    check_workload(kind, context)
    rng = random.Random(f"{seed}:{kind}:{split}" + ("" if context == "lines" else f":{context}"))
    files = files_of_split(split)
    sessions: list[dict] = []
    seen: set[str] = set()  # whole-file contexts draw long files often: one session per prompt
    attempts = 0
    while len(sessions) < n and attempts < 50 * n:
        attempts += 1
        path = rng.choice(files)
        sid = f"{kind}-{split}-{seed}-{len(sessions):05d}"
        if kind == "agentic":
            long = rng.random() < 0.4  # long sessions reach ~18-22k or ~22-29k tokens of context
            s = agentic_session(rng, sid, path, long=long)
        elif kind == "code" and context == "docstring":
            s = docstring_session(rng, sid, path)
        elif kind == "code":
            s = code_session(rng, sid, path, context=context)
        else:
            s = BUILDERS[kind](rng, sid, path)
        if s is not None and context != "lines":
            if s["messages"][0]["content"] in seen:
                continue
            seen.add(s["messages"][0]["content"])
        if s is not None:
            sessions.append(s)
    if len(sessions) < n:
        raise RuntimeError(f"only {len(sessions)} {kind} sessions could be built from {split} files")
    return sessions


def generate_named(name: str, split: str, n: int, seed: int = 0) -> list[dict]:
    """:func:`generate` for a training-data name, ``kind`` or ``kind:context`` (``code:docstring``).
    A context's session ids get ``:context`` appended, so a mix of contexts has unique ids."""
    kind, context = split_name(name)
    sessions = generate(kind, split, n, seed, context=context)
    if context != "lines":
        for s in sessions:
            s["id"] = f"{s['id']}:{context}"
    return sessions


def main(argv: list[str] | None = None) -> None:
    import argparse

    from .schema import write_sessions

    ap = argparse.ArgumentParser(description="Generate agentic/code/chat workload JSONL files.")
    ap.add_argument("--kind", choices=sorted(BUILDERS), required=True)
    ap.add_argument("--split", choices=SPLITS, required=True)
    ap.add_argument("-n", type=int, required=True, help="number of sessions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", choices=CODE_CONTEXTS, default="lines",
                    help="code only: 30-80 lines before the body, the whole file before it, or the whole "
                         "file less one docstring that the reply writes back")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    n = write_sessions(args.out, generate(args.kind, args.split, args.n, args.seed, args.context))
    print(f"wrote {n} {args.kind} sessions ({args.split}) to {args.out}")


if __name__ == "__main__":
    main()
