"""Workload session schema (docs/design.md §6) and its validator.

A workload file is JSONL, one session per line, OpenAI chat format:

    {"id": str, "kind": "agentic" | "code" | "chat", "tools": [tool, ...],
     "messages": [message, ...]}

* ``tools``: OpenAI function tools, ``{"type": "function", "function": {"name",
  "description", "parameters": <JSON schema object>}}`` (may be empty).
* ``messages``: ``system`` (optional, first only), ``user``, ``assistant`` (``content`` str or
  null, optional ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
  "arguments": <JSON string>}}]``), ``tool`` (``tool_call_id``, ``content``).
  Every tool message answers a tool call of the assistant message before it.

``validate_session`` raises ``ValueError`` naming the session, the message index and the fix.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

KINDS = ("agentic", "code", "chat")
ROLES = ("system", "user", "assistant", "tool")


class WorkloadError(ValueError):
    """A workload file or session does not follow docs/design.md §6."""


def _fail(sid: str, where: str, problem: str) -> None:
    raise WorkloadError(f"session {sid!r}, {where}: {problem}")


def validate_tool(sid: str, i: int, tool: Any) -> None:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        _fail(sid, where, 'each tool must be {"type": "function", "function": {...}}')
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        _fail(sid, where, "tool.function.name must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        _fail(sid, where, 'tool.function.parameters must be a JSON schema with "type": "object"')


def validate_session(session: Any) -> None:
    """Check one session dict; raise WorkloadError with an actionable message."""
    if not isinstance(session, dict):
        raise WorkloadError(f"a session must be a JSON object, got {type(session).__name__}")
    sid = session.get("id")
    if not isinstance(sid, str) or not sid:
        raise WorkloadError('every session needs a non-empty string "id"')
    if session.get("kind") not in KINDS:
        _fail(sid, "kind", f"must be one of {KINDS}, got {session.get('kind')!r}")
    tools = session.get("tools", [])
    if not isinstance(tools, list):
        _fail(sid, "tools", "must be a list of OpenAI function tools")
    for i, tool in enumerate(tools):
        validate_tool(sid, i, tool)
    tool_names = {t["function"]["name"] for t in tools}
    messages = session.get("messages")
    if not isinstance(messages, list) or not messages:
        _fail(sid, "messages", "must be a non-empty list")
    open_calls: set[str] = set()
    n_assistant = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            _fail(sid, where, f"role must be one of {ROLES}")
        role = msg["role"]
        if role == "system" and i != 0:
            _fail(sid, where, "a system message may only come first")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if call_id not in open_calls:
                _fail(sid, where, f"tool_call_id {call_id!r} answers no earlier assistant tool call")
            open_calls.discard(call_id)
            if not isinstance(msg.get("content"), str):
                _fail(sid, where, "tool content must be a string")
            continue
        if open_calls:
            _fail(sid, where, f"tool calls {sorted(open_calls)} have no tool result before this message")
        content = msg.get("content")
        if role != "assistant" and not isinstance(content, str):
            _fail(sid, where, f"{role} content must be a string")
        if role == "assistant":
            n_assistant += 1
            calls = msg.get("tool_calls") or []
            if content is None and not calls:
                _fail(sid, where, "assistant message needs content or tool_calls")
            for j, call in enumerate(calls):
                cw = f"{where}.tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(call.get("id"), str):
                    _fail(sid, cw, 'needs "id" and "function": {"name", "arguments"}')
                if tool_names and fn.get("name") not in tool_names:
                    _fail(sid, cw, f"calls unknown tool {fn.get('name')!r}; declare it in tools")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError as exc:
                        _fail(sid, cw, f"arguments is not valid JSON ({exc}); "
                              "OpenAI format wants a JSON-encoded string")
                if not isinstance(args, dict):
                    _fail(sid, cw, "arguments must encode a JSON object")
                open_calls.add(call["id"])
    if open_calls:
        _fail(sid, "messages", f"tool calls {sorted(open_calls)} are never answered")
    if n_assistant == 0:
        _fail(sid, "messages", "a session needs at least one assistant turn to replay")


def read_sessions(path: str) -> Iterator[dict]:
    """Yield validated sessions from a JSONL file (errors name the file and line)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                session = json.loads(line)
                validate_session(session)
            except (json.JSONDecodeError, WorkloadError) as exc:
                raise WorkloadError(f"{path}:{lineno}: {exc}") from None
            yield session


def write_sessions(path: str, sessions: Iterable[dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for session in sessions:
            validate_session(session)
            f.write(json.dumps(session, ensure_ascii=False) + "\n")
            n += 1
    return n
