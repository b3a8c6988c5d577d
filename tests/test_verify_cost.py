"""benchmarks/verify_cost.py: how request timings become decode / verify / draft costs and the
break-even tau (the measurement itself runs vLLM and is a benchmark, not a test)."""

from __future__ import annotations

import pytest

import verify_cost


STEPS = 4


def _sweep(L: int, *, overhead: float, decode: float, per_token: float, k: int, draft=None, real=None,
           first_step: float = 0.0) -> dict:
    """Timings (s) of one sweep at context L for a step costing ``decode + per_token * (n - 1)``,
    every request adding ``overhead`` (request admission, output processing) and its first decode
    step after the prefill ``first_step`` more."""
    ones = [overhead + decode + per_token * n for n in range(k + 1)]  # n = 1..K+1 new tokens
    cell = {"one": ones, "many": ones[0] + first_step + STEPS * decode}
    if real is not None:  # the drafter engine: 3 verify steps of K+1, one draft round per step
        r = draft[0]
        cell.update(draft=draft, dlite_one=(overhead + decode + r, r),
                    dlite_many=(overhead + decode + r + first_step + 3 * (real + r), 4 * r, 4))
    return {L: cell}


def test_decode_and_verify_steps_leave_out_the_request_overhead():
    k = 3
    rows = verify_cost.summarise([_sweep(1024, overhead=0.050, decode=0.010, per_token=0.002, k=k)], k, STEPS)
    row = rows[1024]
    assert row["decode_ms"] == pytest.approx(10.0)
    assert row["verify_ms"] == pytest.approx([10.0, 12.0, 14.0, 16.0])
    assert row["token_ms"] == pytest.approx(2.0)
    assert row["draft_ms"] is None and row["dlite_verify_ms"] is None
    # no draft round measured: break-even = verify / decode, the same as with free drafting
    assert row["break_even_tau"] == pytest.approx([1.2, 1.4, 1.6])
    assert row["break_even_tau_free_draft"] == pytest.approx([1.2, 1.4, 1.6])


def test_break_even_adds_the_draft_round_and_the_real_verify_step_is_separated_from_drafting():
    k = 2
    sweep = _sweep(4096, overhead=0.05, decode=0.020, per_token=0.010, k=k, draft=[0.005, 0.007], real=0.041)
    row = verify_cost.summarise([sweep], k, STEPS)[4096]
    assert row["draft_ms"] == pytest.approx(6.0)  # median of the rounds
    assert row["dlite_verify_ms"] == pytest.approx(41.0)
    assert row["break_even_tau"] == pytest.approx([(30.0 + 6.0) / 20.0, (40.0 + 6.0) / 20.0])
    assert row["break_even_tau_free_draft"] == pytest.approx([1.5, 2.0])


def test_figures_are_medians_over_sweeps_with_every_sweep_kept():
    k = 1
    sweeps = [_sweep(1024, overhead=0.05, decode=d, per_token=0.001, k=k) for d in (0.010, 0.030, 0.012)]
    row = verify_cost.summarise(sweeps, k, STEPS)[1024]
    assert row["decode_ms"] == pytest.approx(12.0)
    assert row["repeats"]["decode_ms"] == pytest.approx([10.0, 30.0, 12.0])
    assert row["verify_ms"] == pytest.approx([12.0, 13.0])


def test_a_costlier_first_step_after_the_prefill_is_spread_over_the_steady_steps():
    """Whatever extra the first decode step after a prefill costs counts 1/STEPS (a mean over steps)."""
    k = 1
    row = verify_cost.summarise([_sweep(1024, overhead=0.05, decode=0.010, per_token=0.001, k=k,
                                        first_step=0.008)], k, STEPS)[1024]
    assert row["decode_ms"] == pytest.approx(10.0 + 8.0 / STEPS)
