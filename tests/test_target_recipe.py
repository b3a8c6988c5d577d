"""The tiny target's long-context stage and its per-length evaluation: windows, masks, buckets."""

import random

import pytest

from paths import TARGET_DIR, WORKLOADS
from lab.target.evaluate import BUCKETS, bucket_of, first_tool_name, well_formed_tool_calls
from lab.target.long import CURRICULUM, file_session_near, length_cap, supervised_window
from lab.target.sft import assistant_spans, turn_markers
from lab.target.train import render_sessions
from vllm_dlite.train.workloads.schema import read_sessions


@pytest.fixture(scope="module")
def session(tok):
    s = next(s for s in read_sessions(str(WORKLOADS / "heldout_agentic.jsonl")))
    doc = render_sessions(tok, [s])[0]
    return doc, assistant_spans(doc, *turn_markers(tok)), s


def test_curriculum_caps_grow_to_the_window():
    caps = [length_cap(p / 100, 30720) for p in range(100)]
    assert caps == sorted(caps)
    assert caps[0] == 8192 and caps[30] == 16384 and caps[-1] == 30720
    assert CURRICULUM[-1][0] == 1.0
    assert {length_cap(p / 100, 30720, "full") for p in range(100)} == {30720}  # a run past the curriculum


def test_window_is_a_session_prefix_ending_at_an_assistant_turn(session, tok):
    doc, spans, s = session
    assert len(spans) == sum(m["role"] == "assistant" for m in s["messages"])
    rng = random.Random(0)
    for cap in (2048, 4096, 8192):
        ids, mask = supervised_window(doc, spans, cap, rng)
        assert ids == doc[: len(ids)] and len(mask) == len(ids)
        # the last turn end at <= L (L >= cap / 2): no turn ends between the window and cap / 2
        assert len(ids) <= cap and any(stop == len(ids) for _, stop in spans)
        assert not any(len(ids) < stop <= cap // 2 for _, stop in spans)
        assert tok.decode(ids[-1:]) == "<|im_end|>"
        # every assistant token in the window is supervised, and nothing else
        expected = [0] * len(ids)
        for a, b in spans:
            for i in range(a, min(b, len(ids))):
                expected[i] = 1
        assert mask == expected and 0 < sum(mask) < len(ids)


def test_whole_file_steps_train_every_length_up_to_the_cap_about_equally():
    # sessions skewed short as the generator makes them: 90% under 4k tokens, 10% in 4k-32k
    items = [([0] * n, []) for n in [1000 + 3 * i for i in range(900)] + [4096 + 280 * i for i in range(100)]]
    rng = random.Random(0)
    picked = [len(file_session_near(items, rng.randint(0, 30720), rng)[0]) for _ in range(4000)]
    long_share = sum(n >= 16384 for n in picked) / len(picked)
    assert 0.4 < long_share < 0.6  # about (30720 - 16384) / 30720 of the steps, not the 5% drawn at random
    assert min(picked) == 1000 and max(picked) >= 4096 + 280 * 95


def test_buckets_cover_the_window():
    assert [b[2] for b in BUCKETS] == ["0-2k", "2k-4k", "4k-8k", "8k-16k", "16k-32k"]
    assert bucket_of(0) == "0-2k" and bucket_of(2047) == "0-2k" and bucket_of(2048) == "2k-4k"
    assert bucket_of(16384) == "16k-32k" and bucket_of(32767) == "16k-32k" and bucket_of(32768) is None


def test_well_formed_tool_calls(session):
    tools = session[2]["tools"]
    ok = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "start": 1, "end": 9}}\n</tool_call>'
    assert well_formed_tool_calls("Reading.\n" + ok, tools) and first_tool_name(ok) == "read_file"
    assert not well_formed_tool_calls("</tool_response>", tools)
    assert not well_formed_tool_calls(ok.replace('"path": "a.py", ', ""), tools)  # required parameter missing
    assert not well_formed_tool_calls(ok.replace("read_file", "py"), tools)  # no such tool
    assert not well_formed_tool_calls(ok.replace('{"name"', '{"cmd", "name"'), tools)  # not JSON


def test_a_code_reply_is_well_formed_when_it_is_one_finished_nonempty_python_body():
    from lab.target.evaluate import scored_kind, well_formed_code_reply

    body = "```python\n        self._fp.seek(0)\n        if self._eof:\n            return 1\n```"
    assert well_formed_code_reply(body) and well_formed_code_reply(body + "\n")
    assert not well_formed_code_reply("```python\n\n```")  # the long-prompt failure: an empty block
    assert not well_formed_code_reply(body[:-4])  # cut before the closing fence
    assert not well_formed_code_reply("Here it is:\n" + body)  # markup around it
    assert not well_formed_code_reply("```python\n        if self._eof\n```")  # does not parse
    assert scored_kind({"content": body}) == "code" and scored_kind({"content": "Done."}) is None
    assert scored_kind({"content": "", "tool_calls": [{"function": {"name": "read_file"}}]}) == "tool"


def test_a_docstring_reply_is_one_finished_block_holding_one_string_of_three_words_or_more():
    from lab.target.evaluate import scored_kind, well_formed_docstring

    reply = '```python\n"""Take the full path \'path\', and make it a relative path."""\n```'
    assert well_formed_docstring(reply) and scored_kind({"content": reply}) == "docstring"
    assert well_formed_docstring(reply.replace("```python\n", "```python\n    ").replace('"""', "'''"))
    assert not well_formed_docstring('```python\n"""Return it."""\n```')  # under 3 words
    assert not well_formed_docstring(reply[:-4])  # cut before the closing fence
    assert not well_formed_docstring("```")  # the long-prompt failure: a bare fence
    code = "```python\n    if not header_name:\n        return header_name\n```"
    assert not well_formed_docstring(code)  # a function body, not a docstring
    assert scored_kind({"content": code}) == "code"
    assert not well_formed_docstring(reply.replace("\n```", "\nreturn 1\n```"))  # code after the string


def test_table_compares_reports_bucket_by_bucket():
    from lab.target.evaluate import format_table

    def report(ok, ce):
        return {"by_bucket": {name: dict(turns_scored=10, well_formed_tool_calls=ok, same_tool_as_reference=ok / 2,
                                         mean_output_tokens=40.0, short_endings=0, heldout_assistant_ce=ce)
                              for _, _, name in BUCKETS}}
    rows = format_table(report(0.9, 0.3), report(0.0, 4.8)).splitlines()[2:]
    assert len(rows) == len(BUCKETS) and rows[-1].startswith("| 16k-32k | 10 |")
    assert "0.0% -> **90.0%**" in rows[0] and "4.8 -> **0.3**" in rows[0]
    assert "->" not in format_table(report(0.9, 0.3))


def _tiny_target(src):
    """A one-layer Qwen3 with the shipped target's tokenizer and chat template, saved at src."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32768,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=[2, 0])
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TARGET_DIR / name, src / name)
    return src


@pytest.mark.slow
def test_long_stage_resumes_where_it_stopped(tmp_path):
    """Two steps, then the same command with a third: the rerun continues from the saved state
    (same first two steps, one more), and the stage is recorded in the training report."""
    import json

    from transformers import Qwen3ForCausalLM

    from lab.target import long

    src = _tiny_target(tmp_path / "tiny")
    common = ["--target", str(src), "--out", str(tmp_path / "out"), "--state", str(tmp_path / "state.pt"),
              "--sessions", "2", "--short-sessions", "2", "--short-batch", "2", "--max-len", "8192",
              "--save-every-s", "0", "--threads", "1"]
    long.main(common + ["--steps", "2"])
    first = [json.loads(line) for line in open(tmp_path / "out" / "train_log_long.jsonl")]
    long.main(common + ["--steps", "3"])
    again = [json.loads(line) for line in open(tmp_path / "out" / "train_log_long.jsonl")]
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in again] == [1, 2, 3]
    assert again[:2] == first
    stages = json.loads((tmp_path / "out" / "training_report.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["long", "long"] and stages[-1]["steps"] == 3
    assert Qwen3ForCausalLM.from_pretrained(tmp_path / "out").config.max_position_embeddings == 32768


@pytest.mark.slow
def test_long_stage_trains_whole_file_completions_within_the_length_cap(tmp_path):
    """--file-sessions: steps on code completions whose prompt is the whole file, each no longer
    than the step's cap, with the loss on the reply (a finite assistant CE)."""
    import json
    import math

    from lab.target import long

    src = _tiny_target(tmp_path / "tiny")
    long.main(["--target", str(src), "--out", str(tmp_path / "out"), "--state", str(tmp_path / "state.pt"),
               "--sessions", "2", "--short-sessions", "2", "--short-share", "0", "--file-sessions", "6",
               "--file-share", "1", "--max-len", "8192", "--steps", "3", "--threads", "1"])
    log = [json.loads(line) for line in open(tmp_path / "out" / "train_log_long.jsonl")]
    assert [r["kind"] for r in log] == ["file"] * 3
    assert all(r["tokens_in_step"] <= r["cap"] and math.isfinite(r["assistant_ce"]) for r in log)
    stage = json.loads((tmp_path / "out" / "training_report.json").read_text())["stages"][-1]
    assert stage["file_sessions"] == 6 and stage["file_share"] == 1


def test_averaging_targets_takes_the_mean_of_every_tensor_and_refuses_other_shapes(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from lab.target.average import average

    a, b, c = (tmp_path / n for n in "abc")
    for d, scale in ((a, 1.0), (b, 3.0)):
        d.mkdir()
        save_file({"w": torch.full((2, 3), scale, dtype=torch.bfloat16), "n": torch.tensor([scale])},
                  str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"scale": scale}))
    average([a, b], tmp_path / "mean")
    mean = load_file(str(tmp_path / "mean" / "model.safetensors"))
    assert mean["w"].dtype == torch.bfloat16 and torch.equal(mean["w"].float(), torch.full((2, 3), 2.0))
    assert mean["n"].item() == 2.0
    assert json.loads((tmp_path / "mean" / "config.json").read_text()) == {"scale": 1.0}
    report = json.loads((tmp_path / "mean" / "training_report.json").read_text())
    assert report["stages"][-1]["sources"] == [str(a), str(b)]
    c.mkdir()
    save_file({"w": torch.zeros(3, 2)}, str(c / "model.safetensors"))
    with pytest.raises(SystemExit, match="does not match"):
        average([a, c], tmp_path / "bad")
