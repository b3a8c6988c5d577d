"""Workload generator: determinism, schema, split by source file, agentic shape, real tool results."""

import ast
import copy
import json

import pytest

from paths import TARGET_DIR, WORKLOADS
from vllm_dlite.train.workloads import generator
from vllm_dlite.train.workloads.replay import load_replay, render_prompt
from vllm_dlite.train.workloads.schema import WorkloadError, read_sessions, validate_session


@pytest.fixture(scope="module")
def heldout_agentic():
    return list(read_sessions(str(WORKLOADS / "heldout_agentic.jsonl")))


@pytest.mark.parametrize("kind", ["agentic", "code", "chat"])
def test_generator_is_deterministic(kind):
    a = generator.generate(kind, "heldout", 3, seed=5)
    b = generator.generate(kind, "heldout", 3, seed=5)
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(generator.generate(kind, "heldout", 3, seed=6))


@pytest.mark.parametrize("kind", ["agentic", "code", "chat"])
def test_shipped_heldout_files_are_reproducible(kind):
    shipped = list(read_sessions(str(WORKLOADS / f"heldout_{kind}.jsonl")))
    fresh = generator.generate(kind, "heldout", min(3, len(shipped)), seed=1)
    assert json.dumps(shipped[: len(fresh)]) == json.dumps(fresh), "run `make workloads`"


def test_split_is_by_source_file():
    train, held = set(generator.files_of_split("train")), set(generator.files_of_split("heldout"))
    assert train and held and not train & held
    assert train | held == set(generator.stdlib_files())
    for s in generator.generate("code", "heldout", 5, seed=2):
        path = s["messages"][0]["content"].split("`")[3]
        assert path in held


def test_schema_rejects_bad_sessions():
    good = generator.generate("agentic", "heldout", 1, seed=3)[0]
    validate_session(good)
    cases = {
        "kind": lambda s: s.update(kind="essay"),
        "answers no earlier": lambda s: s["messages"][3].update(tool_call_id="nope"),
        "not valid JSON": lambda s: s["messages"][2]["tool_calls"][0]["function"].update(arguments="{bad"),
        "unknown tool": lambda s: s["messages"][2]["tool_calls"][0]["function"].update(name="rm_rf"),
        "only come first": lambda s: s["messages"].insert(2, {"role": "system", "content": "x"}),
        "never answered": lambda s: s["messages"].pop(3) and s["messages"].__setitem__(
            slice(3, None), []),
    }
    for needle, mutate in cases.items():
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(WorkloadError, match=needle):
            validate_session(bad)


def test_agentic_tool_results_are_real():
    ws = generator.Workspace()
    s = generator.generate("agentic", "heldout", 1, seed=4)[0]
    calls = {}
    for m in s["messages"]:
        for c in m.get("tool_calls") or []:
            calls[c["id"]] = (c["function"]["name"], json.loads(c["function"]["arguments"]))
        if m["role"] == "tool":
            name, args = calls[m["tool_call_id"]]
            if name == "read_file" and "Edited" not in json.dumps(s["messages"][: s["messages"].index(m)]):
                lines = generator.read_text(args["path"]).splitlines()
                first = m["content"].splitlines()[0]
                assert first.endswith(lines[args["start"] - 1]) or not lines[args["start"] - 1]
            if name == "list_dir":
                assert m["content"] == ws.list_dir(args["path"])
            if name == "run" and args["cmd"].startswith("wc -l"):
                path = args["cmd"].split()[-1]
                assert m["content"] == f"{len(generator.read_text(path).splitlines())} {path}"


def test_agentic_sessions_shape(tok, heldout_agentic):
    """>= 10 turns, short assistant turns, contexts from ~1k to >= 8k tokens (some >= 16k, some
    >= 24k), every turn inside the tiny target's 32k window."""
    longest = []
    for s in heldout_agentic:
        turns = [i for i, m in enumerate(s["messages"]) if m["role"] == "assistant"]
        assert len(turns) >= 10, s["id"]
        first = len(render_prompt(tok, s["messages"][: turns[0]], s["tools"]))
        last = len(render_prompt(tok, s["messages"][: turns[-1]], s["tools"]))
        assert 400 <= first <= 1500, (s["id"], first)
        assert last >= 8000, (s["id"], last)
        longest.append(last)
        for i in turns:
            full = render_prompt(tok, s["messages"][: i + 1], s["tools"])
            assert len(full) - len(render_prompt(tok, s["messages"][:i], s["tools"])) <= 128 + 4
    assert sum(n >= 16000 for n in longest) >= 4
    assert sum(n >= 24000 for n in longest) >= 2
    assert max(longest) <= 30000


def test_replay_one_request_per_assistant_turn(tok, heldout_agentic, tmp_path):
    s = heldout_agentic[0]
    # the shipped file's first session alone (replaying all 24 sessions' turns, up to ~29k tokens each,
    # only to keep this one's would take most of the test's time)
    one = tmp_path / "first_session.jsonl"
    one.write_text((WORKLOADS / "heldout_agentic.jsonl").read_text().splitlines()[0] + "\n")
    reqs = load_replay(str(one), tok, max_turns_per_session=100)
    assert {r.session_id for r in reqs} == {s["id"]}
    mine = [r for r in reqs if r.session_id == s["id"]]
    assert [r.turn for r in mine] == [i for i, m in enumerate(s["messages"]) if m["role"] == "assistant"]
    assert all(len(a.prompt_token_ids) < len(b.prompt_token_ids) for a, b in zip(mine, mine[1:]))
    text = tok.decode(mine[1].prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\n") and "<tool_response>" in text


def _source_and_length_class(prompt: str) -> tuple[str, int]:
    """The code block of a whole-file prompt, and the ``FILE_CONTEXT_CHARS`` class of its length."""
    source = prompt.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
    return source, next(i for i, (lo, hi) in enumerate(generator.FILE_CONTEXT_CHARS) if lo <= len(source) < hi)


def test_code_with_the_whole_file_before_the_body():
    sessions = generator.generate("code", "heldout", 6, seed=1, context="file")
    assert json.dumps(sessions) == json.dumps(generator.generate("code", "heldout", 6, seed=1, context="file"))
    classes = set()
    for s in sessions:
        prompt, body = s["messages"][0]["content"], s["messages"][1]["content"]
        path = prompt.split("`")[3]
        source, length_class = _source_and_length_class(prompt)
        assert generator.read_text(path).startswith(source + "\n")  # from line 1 up to the body
        assert body.removeprefix("```python\n").removesuffix("\n```") not in prompt
        classes.add(length_class)
    assert classes == {0, 1, 2}
    assert len({s["messages"][0]["content"] for s in sessions}) == len(sessions)
    with pytest.raises(ValueError, match="for kind 'code' only"):
        generator.generate("chat", "heldout", 1, context="file")


def test_docstring_questions_about_a_whole_file():
    sessions = generator.generate("code", "heldout", 6, seed=1, context="docstring")
    assert json.dumps(sessions) == json.dumps(generator.generate("code", "heldout", 6, seed=1, context="docstring"))
    classes = set()
    for s in sessions:
        prompt, reply = s["messages"][0]["content"], s["messages"][1]["content"]
        qualname, path = prompt.split("`")[1], prompt.split("`")[3]
        source, length_class = _source_and_length_class(prompt)
        answer = ast.literal_eval(reply.removeprefix("```python\n").removesuffix("\n```"))
        fn = next(f for f in generator.functions_of(path) if f.qualname == qualname
                  and generator.first_paragraph(f.docstring) == answer)
        lines = generator.read_text(path).splitlines()
        a, b = fn.docstring_lines
        assert source == "\n".join(lines[: a - 1] + lines[b:])  # the whole file less that docstring
        assert answer not in " ".join(source.split())  # the reply is not in the prompt
        classes.add(length_class)
    assert classes == {0, 1, 2}
    assert len({s["messages"][0]["content"] for s in sessions}) == len(sessions)


def test_shipped_whole_file_workloads_are_reproducible():
    shipped = list(read_sessions(str(WORKLOADS / "heldout_code_long_file.jsonl")))
    fresh = generator.generate("code", "heldout", 3, seed=1, context="file")
    assert json.dumps(shipped[:3]) == json.dumps(fresh), "run `make workloads`"
    shipped = list(read_sessions(str(WORKLOADS / "heldout_code_docstring.jsonl")))
    fresh = generator.generate("code", "heldout", 3, seed=1, context="docstring")
    assert json.dumps(shipped[:3]) == json.dumps(fresh), "run `make workloads`"


def test_training_data_names_mix_contexts_with_unique_session_ids(tok):
    """``code:docstring`` in ``data.regenerate.kinds`` is the docstring workload under ids of its own:
    the regeneration's request ids (``session#turn``) never collide with plain ``code`` sessions'."""
    from vllm_dlite.train.data import RegenerationConfig, build_requests

    plain = generator.generate("code", "train", 3, seed=1)
    named = generator.generate_named("code:docstring", "train", 3, seed=1)
    assert [s["messages"] for s in named] == [s["messages"] for s in
                                              generator.generate("code", "train", 3, seed=1, context="docstring")]
    assert [s["id"] for s in named] == [s["id"] + ":docstring" for s in plain]
    cfg = RegenerationConfig(kinds={"code": 3, "code:docstring": 3}, max_len=32768, max_new_tokens=64)
    requests = build_requests(TARGET_DIR, cfg, tokenizer=tok)
    assert len({r["id"] for r in requests}) == len(requests) == 6
    with pytest.raises(ValueError, match="context must be one of"):
        generator.generate_named("chat:docstring", "train", 1)


def test_an_unknown_training_data_name_fails_at_config_load():
    from vllm_dlite.train.config import TrainConfig

    cfg = TrainConfig.from_dict({"target": {"path": "/x"}, "run": {"out": "/y"},
                                 "data": {"regenerate": {"kinds": {"code:docstrings": 4}}}})
    with pytest.raises(ValueError, match="'code:docstrings'.*context must be one of"):
        cfg.validate()
