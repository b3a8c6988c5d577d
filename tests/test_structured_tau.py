"""benchmarks/structured_tau.py: what counts as a valid structured reply (the servers' run is the
benchmark's; the serving test of the same cases is test_sampling_matrix.py)."""

import json

import structured_tau as st


def call(arguments: str) -> dict:
    return {"content": "", "tool_calls": [{"function": {"name": "list_dir", "arguments": arguments}}]}


def test_json_cases():
    assert st.valid("json_object", {"content": '{"a": 1}'})
    assert not st.valid("json_object", {"content": "[1]"})
    assert st.valid("json_schema", {"content": json.dumps({"name": "x", "age": 3})})
    assert not st.valid("json_schema", {"content": json.dumps({"name": "x", "age": "3"})})
    assert not st.valid("json_schema", {"content": '{"name": "x", "age":'})


def test_regex_case():
    assert st.valid("regex", {"content": "yes, python."})
    assert not st.valid("regex", {"content": "yes, python. And more"})


def test_tool_cases():
    assert st.valid("tool_required", call('{"path": "src"}'))
    assert not st.valid("tool_required", call('{"path": '))
    assert not st.valid("tool_named", {"content": "no call"})
    assert st.valid("tool_auto", {"content": "an answer in text"})
    assert not st.valid("tool_auto", call("not json"))
