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


def test_merge_refuses_other_settings(tmp_path):
    _earlier_run(tmp_path / "run")
    with pytest.raises(SystemExit, match="max_tokens"):
        ab.previous_results(tmp_path / "run", SETTINGS | {"max_tokens": 128}, ["eagle3"])


def test_merge_into_an_empty_directory_runs_everything(tmp_path):
    assert ab.previous_results(tmp_path, dict(SETTINGS), ["none"]) == ({}, {}, {})
