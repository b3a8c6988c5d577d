"""Replay a workload file as generation requests (docs/design.md §6).

Each assistant turn of each session becomes one request: its prompt is the rendered history
before that turn (the target's chat template, with the session's ``tools``, plus the generation
prompt), and its reference is what the session's assistant said. The demo, the benchmarks and
the drafter's evaluation all build prompts here, so every part replays the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .schema import read_sessions


@dataclass(frozen=True)
class ReplayRequest:
    session_id: str
    kind: str
    turn: int                    # index of the assistant message within the session
    prompt_token_ids: list[int]
    reference: dict              # the session's assistant message at this turn


def chat_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None,
                   add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered with the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if not isinstance(ids, list):  # transformers >= 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ready for the next assistant turn."""
    return chat_token_ids(tokenizer, messages, tools, add_generation_prompt=True)


def replay_requests(sessions: Iterable[dict], tokenizer, max_prompt_tokens: int | None = None,
                    max_turns_per_session: int | None = None) -> list[ReplayRequest]:
    """One request per assistant turn; prompts longer than ``max_prompt_tokens`` are skipped."""
    out: list[ReplayRequest] = []
    for s in sessions:
        n = 0
        for i, msg in enumerate(s["messages"]):
            if msg["role"] != "assistant":
                continue
            ids = render_prompt(tokenizer, s["messages"][:i], s.get("tools"))
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                break  # later turns only get longer
            out.append(ReplayRequest(s["id"], s["kind"], i, ids, msg))
            n += 1
            if max_turns_per_session is not None and n >= max_turns_per_session:
                break
    return out


def load_replay(path: str, tokenizer, **kwargs) -> list[ReplayRequest]:
    return replay_requests(read_sessions(path), tokenizer, **kwargs)
