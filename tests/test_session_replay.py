"""benchmarks/session_replay.py: whole sessions through ``vllm serve`` with the recorded history.

Fast: turn construction from a session, the request body, /metrics deltas, per-request spec-decode
records, stream timings, output comparison. Slow: 1 session x 3 turns with none and dlite at
concurrency 1 (two servers, run side by side with ``--parallel-methods``, and ``--enforce-eager``:
vLLM's compilation would add ~25-50 s to each start-up; neither changes anything checked here),
checking the JSON fields and that dlite's replies equal none's."""

from __future__ import annotations

import json
import sys
import time

import pytest

import session_replay as sr
from repeats import spread

SESSION = {
    "id": "s0", "kind": "agentic",
    "tools": [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}],
    "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"cat a.py\"}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "x = 1\n" * 50},
        {"role": "assistant", "content": "done"},
    ],
}


def test_turns_use_the_recorded_history():
    turns = sr.session_turns(SESSION)
    assert [t.turn for t in turns] == [2, 4, 6] and [t.index for t in turns] == [0, 1, 2]
    assert [t.after for t in turns] == ["user", "tool", "tool"]
    # each turn's history is the workload's messages before it, earlier assistant replies included verbatim
    for t in turns:
        assert t.messages == SESSION["messages"][: t.turn]
    assert turns[2].messages[4] is SESSION["messages"][4]
    assert turns[0].tools == SESSION["tools"] and turns[0].prompt_tokens is None
    assert [t.turn for t in sr.session_turns(SESSION, max_turns=2)] == [2, 4]


def test_turns_stop_at_the_first_prompt_over_the_limit():
    count = lambda messages, tools: sum(len(str(m.get("content", ""))) for m in messages)  # noqa: E731
    turns = sr.session_turns(SESSION, count_tokens=count, max_prompt_tokens=20)
    assert [(t.turn, t.prompt_tokens) for t in turns] == [(2, 9), (4, 18)]  # turn 6 has the 300-char tool result
    assert sr.session_turns({**SESSION, "messages": SESSION["messages"][:2]}) == []


def test_chat_body_is_greedy_streamed_with_token_ids_and_tools():
    t = sr.session_turns(SESSION)[1]
    body = sr.chat_body(t, "m", 16)
    assert body["temperature"] == 0.0 and body["stream"] and body["return_token_ids"] and body["logprobs"] is False
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 16
    assert body["tools"] == SESSION["tools"] and body["messages"] == SESSION["messages"][:4]
    json.dumps(body)  # serialisable as is
    no_tools = sr.Turn("s", 1, 0, "user", [{"role": "user", "content": "hi"}], None)
    assert "tools" not in sr.chat_body(no_tools, "m", 4)


def test_metric_delta_and_hit_rate():
    n = sr.METRIC_NAMES
    before = {n["prefix_cache_hits"]: 100.0, n["prefix_cache_queries"]: 400.0, n["drafts"]: 5.0,
              n["draft_tokens"]: 35.0, n["accepted"]: 10.0, n["requests_finished"]: 2.0}
    after = {n["prefix_cache_hits"]: 1100.0, n["prefix_cache_queries"]: 1600.0, n["drafts"]: 9.0,
             n["draft_tokens"]: 63.0, n["accepted"]: 20.0, n["requests_finished"]: 3.0, "other": 1.0}
    d = sr.metric_delta(before, after)
    assert d == dict(prefix_cache_hits=1000.0, prefix_cache_queries=1200.0, drafts=4.0, draft_tokens=28.0,
                     accepted=10.0, requests_finished=1.0, prefix_cache_hit_rate=pytest.approx(1000 / 1200))
    assert sr.metric_delta({}, {})["prefix_cache_hit_rate"] is None  # a server without speculation / no queries


def test_spec_record_from_the_per_request_histogram():
    rec = sr.spec_record({"speculative_decoding": {"acceptance_histogram": [2, 1, 0, 1], "num_draft_tokens": 12}})
    assert rec == dict(drafts=4, draft_tokens=12, accepted=4, tau=2.0, histogram=[2, 1, 0, 1])
    assert sr.spec_record(None) == dict(drafts=0, draft_tokens=0, accepted=0, tau=None, histogram=[])


def test_stream_timings():
    # sent at 10.0; 1 token at 10.5, then 3 tokens at once at 10.6 (a speculative step), 1 at 10.7; done 10.8
    t = sr.stream_timings(10.0, [(10.5, 1), (10.6, 3), (10.7, 1)], 10.8)
    assert t["ttft_ms"] == pytest.approx(500) and t["tpot_ms"] == pytest.approx(200 / 4)
    assert t["output_tokens_per_s"] == pytest.approx(5 / 0.8) and t["e2e_ms"] == pytest.approx(800)
    one = sr.stream_timings(0.0, [(0.1, 1)], 0.2)
    assert one["tpot_ms"] is None and one["ttft_ms"] == pytest.approx(100)
    assert sr.stream_timings(0.0, [], 1.0)["ttft_ms"] is None


def test_compare_outputs():
    base = {"s/2": [1, 2, 3], "s/4": [4, 5], "s/6": [7]}
    assert sr.compare_outputs(base, dict(base)) == []
    diff = sr.compare_outputs(base, {"s/2": [1, 9, 3], "s/4": [4, 5, 6]})
    assert diff == [dict(turn="s/2", first_diff=1, none_tokens=3, tokens=3),
                    dict(turn="s/4", first_diff=2, none_tokens=2, tokens=3),
                    dict(turn="s/6", first_diff=None, reason="missing in method")]


def test_summarize_level():
    def turn(ttft, tokens, drafts, accepted, cached):
        return dict(status=200, error=None, ttft_ms=ttft, tpot_ms=10.0, completion_tokens=tokens, prompt_tokens=100,
                    cached_tokens=cached, spec=dict(drafts=drafts, draft_tokens=7 * drafts, accepted=accepted))
    turns = [turn(100, 10, 4, 6, 0), turn(300, 20, 6, 9, 80),
             dict(turn(0, 0, 0, 0, 0), status=500, error="boom")]
    delta = sr.metric_delta({}, {sr.METRIC_NAMES["prefix_cache_hits"]: 80, sr.METRIC_NAMES["prefix_cache_queries"]: 200})
    s = sr.summarize_level(turns, 2.0, delta, {"a": {"wall_s": 1.0, "requests_s": 0.5},
                                               "b": {"wall_s": 3.0, "requests_s": 2.5}})
    assert (s["turns"], s["failed_turns"], s["output_tokens"], s["output_tokens_per_s"]) == (3, 1, 30, 15.0)
    assert s["tau"] == pytest.approx(1 + 15 / 10) and s["drafts_per_turn"] == 5 and s["draft_tokens_per_turn"] == 35
    assert s["ttft_ms_median"] == 200 and s["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert s["cached_tokens_share"] == pytest.approx(0.4) and s["session_wall_s_mean"] == 2.0
    assert s["session_wall_s_max"] == 3.0 and s["session_requests_s_mean"] == 1.5


def _pass(tok_s: float, outputs: dict) -> dict:
    summary = dict(output_tokens_per_s=tok_s, ttft_ms_median=100.0, tpot_ms_median=1000 / tok_s, wall_s=60 / tok_s,
                   session_wall_s_mean=20 / tok_s, tau=2.0)
    return {"status": "ok", "by_concurrency": {"1": {"summary": summary, "turns": []}}, "_outputs": {1: outputs}}


def test_repeats_take_medians_and_compare_every_pass():
    same, other = {"s/2": [1, 2, 3]}, {"s/2": [1, 2, 4]}
    none = sr.combine_method_passes([_pass(10.0, same), _pass(12.0, same), _pass(11.0, same)])
    dlite = sr.combine_method_passes([_pass(15.0, same), _pass(13.0, other), _pass(20.0, same)])
    s = dlite["by_concurrency"]["1"]["summary"]
    assert s["output_tokens_per_s"] == 15.0 and s["repeats"]["output_tokens_per_s"] == [15.0, 13.0, 20.0]
    assert s["tpot_ms_median"] == pytest.approx(1000 / 15) and s["tau"] == 2.0  # tau: the first pass's
    results = {"none": none, "dlite": dlite}
    outputs = {m: r.pop("_outputs") for m, r in results.items()}
    sr.add_comparisons(results, outputs)
    assert s["identical_to_none"] is False  # a mismatch in one pass is not hidden by the others
    assert s["mismatches"] == [dict(turn="s/2", first_diff=2, none_tokens=3, tokens=3, **{"pass": 1})]
    failed = {"status": "failed", "reason": "server did not start"}
    assert sr.combine_method_passes([_pass(10.0, same), failed]) is failed
    one_token = _pass(30.0, same)  # every reply one token long: no TPOT in that pass
    one_token["by_concurrency"]["1"]["summary"]["tpot_ms_median"] = None
    s = sr.combine_method_passes([_pass(10.0, same), one_token, _pass(20.0, same)])["by_concurrency"]["1"]["summary"]
    assert s["tpot_ms_median"] == pytest.approx(75.0)  # the median of the passes that measured it
    assert spread(s, "tpot_ms_median") == "75.0 (50.0-100.0)" and spread(s, "output_tokens_per_s") == "20.0 (10.0-30.0)"
    assert spread(dict(tpot_ms_median=None), "tpot_ms_median") == "-"


def _dlite_drafter(tmp_path):
    """The shipped drafter when it passes the checkpoint check, else a dlite_v1 copy drafter for the
    shipped target (tests/helpers_vllm.py; drafts the anchor repeated, so some drafts are accepted):
    this test checks the harness, not the drafter's quality."""
    import helpers_vllm as H
    from paths import DRAFTER_DIR, TARGET_DIR

    from vllm_dlite.model.checkpoint import CheckpointError, check_checkpoint

    try:
        if check_checkpoint(DRAFTER_DIR).block_size - 1 >= 7:
            return DRAFTER_DIR
    except (CheckpointError, OSError) as exc:
        print(f"shipped drafter not usable ({str(exc)[:120]}); using a copy drafter", file=sys.stderr)
    return H.make_copy_drafter(tmp_path / "copy_drafter", TARGET_DIR, block_size=8)  # K = 7


@pytest.mark.slow
def test_session_replay_none_and_dlite_identical(tmp_path, monkeypatch, runner):
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # 1 GiB: ~87k tokens, plenty for 3 turns under 2k tokens
    drafter = _dlite_drafter(tmp_path)
    out = tmp_path / "sr"
    t0 = time.time()
    rc = sr.main(["--methods", "none,dlite", "--concurrency", "1", "--max-sessions", "1", "--max-turns", "3",
                  "--max-tokens", "12", "--enforce-eager", "--parallel-methods", "--dlite", str(drafter),
                  "--runner", runner, "--out", str(out)])
    print(f"session replay: {time.time() - t0:.0f} s", file=sys.stderr)
    res = json.loads((out / "results.json").read_text())
    assert rc == 0, (out / "results.md").read_text()
    assert res["settings"]["sessions"] == 1 and res["settings"]["turns"] == 3 and res["settings"]["enforce_eager"]
    assert res["settings"]["parallel_methods"] and res["settings"]["runner"] == runner
    for m in ("none", "dlite"):
        r = res["methods"][m]
        assert r["status"] == "ok", r
        level = r["by_concurrency"]["1"]
        s = level["summary"]
        assert s["turns"] == 3 and s["failed_turns"] == 0 and s["sessions"] == 1
        for key in ("ttft_ms_median", "tpot_ms_median", "output_tokens_per_s", "prefix_cache_hit_rate",
                    "session_wall_s_mean", "session_requests_s_mean", "metrics_delta"):
            assert s[key] is not None, key
        turns = level["turns"]
        assert [t["turn"] for t in turns] == [2, 4, 6] and [t["after"] for t in turns][1:] == ["tool", "tool"]
        for t in turns:
            assert t["status"] == 200 and t["token_ids_complete"] and t["completion_tokens"] > 0
            assert t["ttft_ms"] > 0 and t["prompt_tokens"] > 0 and t["metrics_delta"]["prefix_cache_queries"] > 0
        # each turn's prompt extends the previous one (recorded history): the prefix cache hits from turn 2 on
        assert all(t["cached_tokens"] for t in turns[1:])
    dl = res["methods"]["dlite"]["by_concurrency"]["1"]
    assert dl["summary"]["identical_to_none"] is True and dl["summary"]["mismatches"] == []
    assert dl["summary"]["drafts"] > 0 and dl["summary"]["tau"] >= 1
    for t in dl["turns"]:  # the request's own record agrees with the /metrics deltas at concurrency 1
        assert t["spec"]["drafts"] == t["metrics_delta"]["drafts"]
        assert t["spec"]["accepted"] == t["metrics_delta"]["accepted"]
    assert res["methods"]["none"]["by_concurrency"]["1"]["summary"]["drafts"] == 0
    outputs = json.loads((out / "outputs.json").read_text())
    assert outputs["none"]["1"] == outputs["dlite"]["1"]
    assert "| dlite | 1 |" in (out / "results.md").read_text()


def test_binned_medians():
    pts = [(100, 1.0), (100, 3.0), (900, 5.0), (2000, 6.0), (10000, 7.0), (10000, 9.0)]
    # 2 bins split at 1000 (log-spaced between 100 and 10000); the last edge is inclusive
    assert sr.binned_medians(pts, bins=2) == [(100, 3.0), (10000, 7.0)]
    assert sr.binned_medians([(5, 1.0), (5, 2.0)]) == [(5, 1.5)]
