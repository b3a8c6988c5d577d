"""Tokenizer round trip and chat-template rendering of every message type."""

import json

import pytest

from vllm_dlite.train.workloads.generator import AGENT_TOOLS, read_text, stdlib_files


def test_vocab_and_special_tokens(tok):
    assert 4000 <= len(tok) <= 16000
    assert tok.eos_token == "<|im_end|>"
    for t in ("<|mask|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, f"{t} must be one token, got {ids}"
    assert tok.mask_token == "<|mask|>"
    # tool markup survives skip_special_tokens so vLLM's hermes parser sees it
    ids = tok.encode("<tool_call>\n{}\n</tool_call>", add_special_tokens=False)
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("path", [p for p in stdlib_files() if p in ("json/decoder.py", "textwrap.py", "heapq.py")])
def test_round_trip_stdlib(tok, path):
    text = read_text(path)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_round_trip_unicode_and_whitespace(tok):
    text = "naïve café — 日本語 🙂\n\t  x = {'a': [1, 2]}\r\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _render(tok, messages, tools=None, gen=False):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def test_chat_template_every_message_type(tok):
    args = {"path": "json/decoder.py", "start": 1, "end": 5}
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "USER"},
        {"role": "assistant", "content": "THINK", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": json.dumps(args)}},
            {"id": "c1", "type": "function", "function": {"name": "list_dir", "arguments": '{"path": "json"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "RESULT0"},
        {"role": "tool", "tool_call_id": "c1", "content": "RESULT1"},
        {"role": "assistant", "content": "ANSWER"},
    ]
    text = _render(tok, messages, tools=AGENT_TOOLS, gen=True)
    assert text.startswith("<|im_start|>system\nSYS\n\n# Tools")
    for tool in AGENT_TOOLS:
        assert json.dumps(tool) in text  # tools rendered as JSON, once each
    assert "<|im_start|>user\nUSER<|im_end|>\n" in text
    assert ('<|im_start|>assistant\nTHINK\n<tool_call>\n{"name": "read_file", "arguments": '
            + json.dumps(args) + '}\n</tool_call>\n<tool_call>\n{"name": "list_dir"') in text
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n<tool_response>\nRESULT0\n</tool_response>\n<tool_response>\nRESULT1"
            "\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\nANSWER<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_arguments_string_or_object(tok):
    args = {"pattern": "def x", "path": "json"}

    def msgs(a):
        return [{"role": "user", "content": "u"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "grep", "arguments": a}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}]
    assert _render(tok, msgs(json.dumps(args)), AGENT_TOOLS) == _render(tok, msgs(args), AGENT_TOOLS)


def test_chat_template_without_tools_or_system(tok):
    text = _render(tok, [{"role": "user", "content": "hi"}], gen=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = _render(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
