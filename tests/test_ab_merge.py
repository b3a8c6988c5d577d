"""benchmarks/ab.py --merge: a new method joins an earlier run only when every setting that shapes
the figures is the same, and keeps the earlier methods' results and greedy outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


import ab  # noqa: E402

SETTINGS = {k: 1 for k in ab.SAME_RUN_KEYS} | {"command": "python benchmarks/ab.py --methods none,dlite"}


def _earlier_run(out: Path) -> None:
    out.mkdir()
    methods = {"none": {"status": "ok", "tau": None}, "dlite": {"status": "ok", "tau": 2.0}}
    (out / "results.json").write_text(json.dumps({"settings": SETTINGS, "methods": methods}))
    (out / "outputs.json").write_text(json.dumps({"none": {"1": [[5, 6]]}, "dlite": {"1": [[5, 6]]}}))


def test_merge_keeps_earlier_methods_not_rerun(tmp_path):
    _earlier_run(tmp_path / "run")
    kept, outputs, earlier = ab.previous_results(tmp_path / "run", dict(SETTINGS), ["eagle3", "dlite"])
    assert list(kept) == ["none"]  # dlite is measured again, so its old figures are dropped
    assert outputs == {"none": {1: [[5, 6]]}}  # concurrency keys back to int, as in a fresh run
    assert earlier["command"] == SETTINGS["command"]  # named in the merged run's results


def test_merge_of_a_run_from_before_the_runner_was_recorded_takes_it_as_v1(tmp_path):
    _earlier_run(tmp_path / "run")
    old = json.loads((tmp_path / "run" / "results.json").read_text())
    old["settings"].pop("runner")
    (tmp_path / "run" / "results.json").write_text(json.dumps(old))
    ab.previous_results(tmp_path / "run", dict(SETTINGS, runner="v1"), ["dlite"])  # same settings: kept
    with pytest.raises(SystemExit, match="runner"):
        ab.previous_results(tmp_path / "run", dict(SETTINGS, runner="v2"), ["dlite"])


def test_merge_refuses_other_settings(tmp_path):
    _earlier_run(tmp_path / "run")
    with pytest.raises(SystemExit, match="max_tokens"):
        ab.previous_results(tmp_path / "run", SETTINGS | {"max_tokens": 128}, ["eagle3"])


def test_merge_into_an_empty_directory_runs_everything(tmp_path):
    assert ab.previous_results(tmp_path, dict(SETTINGS), ["none"]) == ({}, {}, {})


# ----------------------------------------------------------------------------- tau by prompt length
def _rec(prompt_tokens: int, hist: list[int], draft_tokens: int | None = None) -> dict:
    return {"prompt_tokens": prompt_tokens, "histogram": hist,
            "draft_tokens": 3 * sum(hist) if draft_tokens is None else draft_tokens}


def test_tau_by_prompt_tokens_from_histograms():
    # K = 3: hist[j] = verify steps with exactly j accepted draft tokens
    records = [
        _rec(100, [1, 1, 0, 2]),      # 4 drafts, accepted 0+1+0+6 = 7
        _rec(2047, [0, 0, 2, 0]),     # 2 drafts, accepted 4; 2047 is still 0-2k
        _rec(2048, [3, 0, 0, 1]),     # 2k-8k: 4 drafts, accepted 3
        _rec(9000, [], 0),            # 8k-32k: a request without drafts (none, or nothing proposed)
    ]
    b = ab.tau_by_prompt_tokens(records)
    assert list(b) == ["0-2k", "2k-8k", "8k-32k"]  # exactly these buckets, in order
    low = b["0-2k"]
    assert (low["requests"], low["drafts"], low["accepted"], low["draft_tokens"]) == (2, 6, 11, 18)
    assert low["tau"] == pytest.approx(1 + 11 / 6)
    # position i accepted in sum_{j>i} hist[j] drafts: pos0 = (1+0+2)+(0+2+0) = 5, pos1 = 2+2 = 4, pos2 = 2
    assert low["tau_per_position"] == pytest.approx([5 / 6, 4 / 6, 2 / 6])
    assert sum(low["tau_per_position"]) == pytest.approx(low["tau"] - 1)  # tau - 1 = sum of position rates
    assert low["prompt_tokens_mean"] == pytest.approx((100 + 2047) / 2)
    mid = b["2k-8k"]
    assert (mid["requests"], mid["drafts"], mid["accepted"]) == (1, 4, 3)
    assert mid["tau_per_position"] == pytest.approx([0.25, 0.25, 0.25])
    high = b["8k-32k"]
    assert (high["requests"], high["drafts"], high["tau"], high["tau_per_position"]) == (1, 0, None, [])


def test_tau_by_prompt_tokens_empty_buckets_and_scatter_points():
    b = ab.tau_by_prompt_tokens([])
    assert all(v["requests"] == 0 and v["tau"] is None and v["prompt_tokens_mean"] is None for v in b.values())
    assert ab.per_request_tau([_rec(100, [1, 1, 0, 2]), _rec(50, [])]) == [[100, 4, 7], [50, 0, 0]]


def test_max_prompt_tokens_over_the_target_context_fails_before_any_engine(tmp_path, capsys):
    wl = tmp_path / "w.jsonl"
    wl.write_text("")
    with pytest.raises(SystemExit):
        ab.main(["--workload", str(wl), "--out", str(tmp_path / "o"), "--methods", "none",
                 "--max-prompt-tokens", "40000"])
    err = capsys.readouterr().err
    assert "max_position_embeddings 32768" in err and "--max-prompt-tokens 32689 or less" in err


def test_markdown_has_the_bucket_table_and_tolerates_merged_methods_without_it(tmp_path):
    records = [_rec(100, [1, 1, 0, 2]), _rec(3000, [0, 2, 0, 0])]
    settings = dict(SETTINGS, workload="w.jsonl", target="t", k=3, temperature=0.0, max_tokens=8, dtype="float32",
                    num_requests=2, prompt_tokens_min=100, prompt_tokens_max=3000, device="cpu", runner="v2")
    ok = dict(status="ok", tau=2.0, tau_per_position=[0.5], by_concurrency={"1": {"output_tokens_per_s": 1.0}},
              mean_itl_ms=1.0, kv_pool_tokens=10, draft_ms_by_context={})
    results = {"none": dict(ok, tau=None, tau_per_position=[]),  # merged from a run without the table
               "dlite": dict(ok, tau_by_prompt_tokens=ab.tau_by_prompt_tokens(records),
                             per_request_tau=ab.per_request_tau(records))}
    ab.write_markdown(tmp_path / "r.md", settings, results, [1])
    md = (tmp_path / "r.md").read_text()
    assert "vLLM Model Runner V2" in md
    assert "| dlite | 0-2k | 1 | 4 | 2.75 | 0.75 0.50 0.50 |" in md
    assert "| dlite | 8k-32k | 0 | 0 | - | - |" in md
    assert "| none | - | - | - | - | not recorded |" in md
    pytest.importorskip("matplotlib")
    assert "tau_by_prompt_tokens.png" in ab.write_plots(tmp_path, results, [1])
    assert (tmp_path / "tau_by_prompt_tokens.png").stat().st_size > 0


def test_method_at_k_names_a_fixed_k_variant_and_bad_ones_fail_before_any_engine(tmp_path, capsys):
    assert ab.parse_method("dlite@3") == ("dlite", 3)
    assert ab.parse_method("dlite") == ("dlite", None)
    workload = tmp_path / "w.jsonl"
    workload.write_text("")
    for methods, message in (("none,dlite@9", "1 <= k <= -k"), ("none@2", "speculative method"),
                             ("dlite@x", "NAME@k"), ("dlit@3", "unknown")):
        with pytest.raises(SystemExit):
            ab.main(["--workload", str(workload), "--out", str(tmp_path / "o"), "--methods", methods])
        assert message in capsys.readouterr().err, methods


def test_per_request_rounds_from_draft_timer_records():
    # DraftRound fields: seconds, drafter_seconds, n, context, verifying, sampled, req_ids, drafted
    recs = [
        [0.1, 0.1, 1, 900, False, [0], ["a"], [0]],    # partial prefill chunk of a
        [0.1, 0.1, 1, 1000, False, [1], ["a"], [0]],   # last chunk: a's first token
        [0.1, 0.1, 1, 1003, True, [4], ["a"], [7]],    # a's first verification: 3 of 7 accepted
        [0.1, 0.1, 1, 1004, True, [1], ["a"], [0]],    # a decoding step without drafts
        [0.1, 0.1, 1, 50, False, [1], ["b"], [0]],     # b's prefill
        [0.1, 0.1, 1, 58, True, [8], ["b"], [7]],      # all 7 accepted
    ]
    assert ab.per_request_rounds(recs) == [[[7, 3], [0, 0]], [[7, 7]]]
    assert ab.per_request_rounds([r[:5] for r in recs]) == []  # V2 / older records: not known


def test_sampled_counts_read_both_forms_of_the_runners_sampled_tokens():
    import torch

    from lab.harness.replay import sampled_counts

    assert sampled_counts([[5, 6, 7], [], [9]], 3) == (3, 0, 1)  # lists of valid ids (after bookkeeping)
    padded = torch.tensor([[5, 6, -1, -1], [7, 8, 9, 10], [1, -1, -1, -1]])  # rejection sampler, -1 padded
    assert sampled_counts(padded, 2) == (2, 4)
