"""The paired bootstrap of lab/experiments/tau_gap.py (issue 38's targets against the turns' spread)."""

import numpy as np

from lab.experiments.tau_gap import compare, tau


def test_tau_pools_accepted_over_drafts():
    rows = np.array([[100, 10, 20], [200, 30, 20]])  # [prompt tokens, drafts, accepted]
    assert tau(rows) == 1 + 40 / 40


def test_the_same_drafter_against_itself_is_a_tie_in_every_draw():
    rows = np.array([[10, 5, 3], [20, 7, 14], [30, 4, 0], [40, 9, 9]])
    c = compare(rows, rows, 500, np.random.default_rng(0))
    assert c["ratio"] == c["lo"] == c["hi"] == 1.0 and c["p_a_ge_b"] == 1.0


def test_a_drafter_better_on_every_turn_wins_every_draw_and_the_draws_are_paired():
    b = np.array([[10, 10, 5], [20, 10, 1], [30, 10, 30], [40, 10, 8]])
    a = b.copy()
    a[:, 2] += 2  # two more accepted tokens on each turn
    c = compare(a, b, 500, np.random.default_rng(0))
    assert c["p_a_ge_b"] == 1.0 and c["lo"] > 1.0 and c["ratio"] == tau(a) / tau(b)
    # unpaired draws would let a's bad turns meet b's good ones; paired, the worst draw still wins
    worse = compare(b, a, 500, np.random.default_rng(0))
    assert worse["p_a_ge_b"] == 0.0 and worse["hi"] < 1.0
