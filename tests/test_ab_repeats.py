"""benchmarks/ab.py --repeats: a method's cells become the medians of its passes, every pass's
values are kept as the spread, and a failed pass is not hidden behind the others."""

from __future__ import annotations

import ab
from repeats import spread


def _run(tok_s: dict[int, float], tau: float = 2.0, outputs=None) -> dict:
    cells = {str(c): {"output_tokens_per_s": v, "mean_itl_ms": 1000 / v, "wall_s": 100 / v, "tau": tau,
                      "output_tokens": 100} for c, v in tok_s.items()}
    low = cells[str(min(tok_s))]
    return {"status": "ok", "tau": tau, "by_concurrency": cells, **{k: low[k] for k in ab.REPEATED_KEYS},
            "_outputs": outputs or {c: [[1, 2]] for c in tok_s}}


def test_cells_are_medians_of_the_passes_and_keep_the_spread():
    runs = [_run({1: 10.0, 4: 40.0}, tau=2.5), _run({1: 14.0, 4: 30.0}, tau=2.4), _run({1: 11.0, 4: 35.0})]
    out = ab.combine_repeats(runs)
    assert out["tau"] == 2.5  # tau, histograms and draft times: the first pass's
    assert out["by_concurrency"]["1"]["output_tokens_per_s"] == 11.0
    assert out["by_concurrency"]["4"]["output_tokens_per_s"] == 35.0
    assert out["by_concurrency"]["4"]["repeats"]["output_tokens_per_s"] == [40.0, 30.0, 35.0]
    assert out["output_tokens_per_s"] == 11.0  # the lowest concurrency's median, like the cell
    assert len(out["_outputs"]) == 3  # every pass's outputs are checked against none's
    assert spread(out["by_concurrency"]["4"], "output_tokens_per_s") == "35.0 (30.0-40.0)"


def test_one_pass_is_reported_as_measured():
    run = _run({1: 12.0})
    outputs = run["_outputs"]
    assert ab.combine_repeats([run]) is run
    assert run["_outputs"] == [outputs]  # one pass's outputs, in the same list form as N passes'
    assert spread(run["by_concurrency"]["1"], "output_tokens_per_s") == "12.0"


def test_a_failed_pass_fails_the_method():
    failed = {"status": "failed", "reason": "concurrency 4: boom"}
    assert ab.combine_repeats([_run({1: 10.0}), failed]) is failed
