"""dlite-adaptive and dlite-hybrid (issue 18): decision logic (fast) and engine runs (slow).

Fast: options and config mapping, the measured cost model's fit, the throughput-maximising length
choice, the calibration of the head's probabilities, the per-position running acceptance, the
hybrid's source choice, the controller's phases, a request that stopped drafting being tried
again, and the V2 / async-scheduling refusals.

Slow (``@pytest.mark.slow``, tiny random models of ``helpers_vllm``, in-process engine): greedy
outputs identical to no speculation for both methods; a cost model where drafting cannot pay
proposes nothing, one where it always pays proposes K; the hybrid proposes with the suffix tree on
a repetitive prompt and with DLite where the context has no match; sampled outputs keep the
target's distribution (chi-square, as in ``test_vllm_sampling.py``).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import helpers_vllm as H  # noqa: E402

from vllm_dlite.vllm.adaptive import (ADDITIONAL_CONFIG_KEY, AdaptiveController, AdaptiveOptions,
                                      Match, check_runner)
from vllm_dlite.vllm.adaptive.cost import (AcceptanceStats, CostModel, choose_lengths, choose_source,
                                            ConfidenceCalibration, expected_from_confidence)

H.apply_vllm_env()
torch.set_num_threads(1)

K = H.BLOCK_K
FREE = {"step_s": 0.01, "request_s": 0.0, "token_s": 0.0, "draft_s": 0.0}  # drafting always pays
EXPENSIVE = {"step_s": 0.01, "request_s": 0.0, "token_s": 0.01, "draft_s": 1.0}  # never pays


# =========================================================================== options / config
def test_options_validate_with_one_message():
    opts = AdaptiveOptions.from_dict("hybrid", {"min_gain": 0.2, "suffix_max_tree_depth": 16})
    assert opts.mode == "hybrid" and opts.min_gain == 0.2 and opts.suffix_max_tree_depth == 16
    assert AdaptiveOptions.from_dict("adaptive").mode == "adaptive"
    for bad, needle in [({"confidence": 0.1}, "unknown option(s) ['confidence']"),
                        ({"calibration_bins": 0}, "calibration_bins = 0"),
                        ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob"),
                        ({"cost_model": {"step": 1}}, "cost_model"),
                        ({"probe_every": -1}, "probe_every")]:
        with pytest.raises(ValueError, match=None) as err:
            AdaptiveOptions.from_dict("adaptive", bad)
        assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown DLite drafting mode"):
        AdaptiveOptions.from_dict("turbo")


def test_hybrid_without_arctic_inference_is_refused_with_the_fix(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import fails
    with pytest.raises(ValueError, match="install_suffix_decoding.sh") as err:
        AdaptiveOptions.from_dict("hybrid")
    assert "dlite-adaptive" in str(err.value) and "\n" not in str(err.value)
    AdaptiveOptions.from_dict("adaptive")  # the adaptive method does not need it


def test_adaptive_methods_are_refused_where_vllm_has_no_v1(models):
    """vLLM 0.34 has no Model Runner V1: ``dlite-adaptive`` / ``dlite-hybrid`` fail at config load
    with one message that names the fix (``dlite``)."""
    from lab.harness.runners import available_runners
    from vllm_dlite.vllm import plugin

    if "v1" in available_runners():
        pytest.skip("this vLLM has Model Runner V1: the methods are served")
    cfg = H.target_config(models.target)
    for method in ("dlite-adaptive", "dlite-hybrid"):
        with pytest.raises(ValueError, match=f"'{method}' needs Model Runner V1.*use 'method': 'dlite'") as err:
            plugin.prepare_speculative_config({"method": method, "model": str(models.drafter)}, cfg)
        assert "\n" not in str(err.value)


@pytest.mark.v1
def test_methods_map_to_dflash_and_carry_options(models):
    from vllm_dlite.vllm import plugin

    cfg = H.target_config(models.target)
    out = plugin.prepare_speculative_config(
        {"method": "dlite-adaptive", "model": str(models.drafter),
         "dlite_options": {"min_gain": 0.1}}, cfg)
    assert out["method"] == "dflash" and out["num_speculative_tokens"] == K
    assert "dlite_options" not in out
    assert out[ADDITIONAL_CONFIG_KEY]["mode"] == "adaptive"
    assert out[ADDITIONAL_CONFIG_KEY]["min_gain"] == 0.1
    out = plugin.prepare_speculative_config({"method": "dlite-hybrid", "model": str(models.drafter)}, cfg)
    assert out[ADDITIONAL_CONFIG_KEY]["mode"] == "hybrid"
    assert ADDITIONAL_CONFIG_KEY not in plugin.prepare_speculative_config(
        {"method": "dlite", "model": str(models.drafter)}, cfg)
    with pytest.raises(ValueError, match="applies to"):
        plugin.prepare_speculative_config(
            {"method": "dlite", "model": str(models.drafter), "dlite_options": {}}, cfg)
    with pytest.raises(ValueError, match="unknown option"):
        plugin.prepare_speculative_config(
            {"method": "dlite-hybrid", "model": str(models.drafter), "dlite_options": {"x": 1}}, cfg)


@pytest.mark.v1
def test_engine_config_carries_the_mode_to_the_workers_and_v2_refuses_it(models):
    """``additional_config`` reaches the workers; Model Runner V2 (GPU default) fails with the fix."""
    pytest.importorskip("vllm")
    import vllm.v1.worker.gpu.spec_decode as spec_decode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dlite.vllm import plugin
    from vllm_dlite.vllm.adaptive import options_from_vllm_config

    plugin.register()
    config = EngineArgs(model=str(models.target), dtype="float32", max_model_len=256,
                        speculative_config={"method": "dlite-hybrid", "model": str(models.drafter),
                                            "dlite_options": {"suffix_max_tree_depth": 16}}).create_engine_config()
    assert config.speculative_config.method == "dflash" and plugin.is_dlite_draft(config.speculative_config)
    opts = options_from_vllm_config(config)
    assert opts.mode == "hybrid" and opts.suffix_max_tree_depth == 16
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        spec_decode.init_speculator(config, torch.device("cpu"))
    plain = EngineArgs(model=str(models.target), dtype="float32", max_model_len=256,
                       speculative_config={"method": "dlite", "model": str(models.drafter)}).create_engine_config()
    assert options_from_vllm_config(plain) is None


def test_check_runner():
    opts = AdaptiveOptions.from_dict("adaptive")
    check_runner(None, "v2")  # plain dlite: nothing to refuse
    check_runner(opts, "v1")
    with pytest.raises(ValueError, match="dlite-adaptive.*Model Runner V2"):
        check_runner(opts, "v2")
    with pytest.raises(ValueError, match="--no-async-scheduling"):
        check_runner(opts, "v1", async_scheduling=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        check_runner(opts, "v1", tensor_parallel_size=2)


# =========================================================================== cost model
def test_cost_model_recovers_measured_costs():
    cost = CostModel(window=64, decay=1.0)
    assert not cost.ready
    rng = np.random.default_rng(0)
    for t in range(60):
        B = int(rng.integers(1, 9))
        drafts = int(rng.integers(0, K * B + 1)) if t % 2 else 0
        accepted = int(rng.integers(0, drafts + 1))
        cost.observe_step(B, B + drafts, 0.010 + 0.002 * B + 0.0005 * drafts + 0.0008 * accepted
                          + rng.normal(0, 1e-5), accepted)
        cost.observe_draft(B, 0.003 + 0.0001 * B)
    assert cost.ready
    assert cost.step_seconds(4) == pytest.approx(0.018, rel=0.02)
    assert cost.token_seconds(4) == pytest.approx(0.0005, rel=0.05)
    assert cost.accepted_seconds() == pytest.approx(0.0008, rel=0.05)  # emitted tokens, kept apart
    assert cost.step_seconds(4, 4 + 8) == pytest.approx(0.022, rel=0.02)
    assert cost.draft_seconds(4) == pytest.approx(0.0034, rel=0.02)
    cost.observe_draft(4, 5.0)  # a one-off stall is clipped, not learned
    assert cost.draft_seconds(4) < 0.01


def test_cost_model_follows_a_drifting_step():
    """The base step grows with the context while drafting turns on later in the run: the drift
    must not be charged to the drafts (one least-squares fit over the window made the per-token
    cost 3x too large here)."""
    cost = CostModel(window=64)
    for t in range(120):
        drafts = K if (t >= 60 or t % 6 == 0) else 0
        accepted = t % 3 if drafts else 0
        cost.observe_step(1, 1 + drafts, 0.010 + 0.0002 * t + 0.001 * drafts + 0.0003 * accepted, accepted)
        cost.observe_draft(1, 0.004)
    assert cost.token_seconds(1) == pytest.approx(0.001, rel=0.05)
    assert cost.accepted_seconds() == pytest.approx(0.0003, rel=0.1)
    assert cost.step_seconds(1) == pytest.approx(0.010 + 0.0002 * 119, rel=0.02)  # the latest level
    # a gap (a prefill step between two decode steps) pairs nothing: the jump is level, not slope
    cost.observe_step(1, 1, 0.050, consecutive=False)
    assert cost.token_seconds(1) == pytest.approx(0.001, rel=0.05)


def test_cost_model_fixed():
    cost = CostModel(fixed={"step_s": 0.01, "request_s": 0.001, "token_s": 0.002, "draft_s": 0.005,
                            "draft_request_s": 0.001})
    assert cost.ready
    assert cost.step_seconds(2, 5) == pytest.approx(0.01 + 0.002 + 0.006)
    assert cost.draft_seconds(3) == pytest.approx(0.008)


# =========================================================================== decisions
def test_head_probabilities_are_calibrated_by_measured_acceptance():
    cal = ConfidenceCalibration(bins=10, strength=2.0, decay=1.0)
    assert cal.alpha([0.9, 0.35]) == pytest.approx([0.9, 0.35])  # no evidence: the head's word
    for _ in range(50):  # an overconfident head: its 0.9 tokens are accepted half the time
        cal.observe([0.9, 0.9, 0.9], accepted=1)  # the first accepted, the second rejected, the third unseen
    assert cal.alpha([0.9])[0] == pytest.approx(0.5, abs=0.02)
    assert cal.alpha([0.35])[0] == pytest.approx(0.35)  # another bin: still the prior
    assert cal.cumulative([0.9, 0.9]) == pytest.approx([0.5 ** 1, 0.5 ** 2], abs=0.02)
    assert cal.summary()[9] == (pytest.approx(0.5), 100.0)


def test_choose_lengths_follows_the_cost_model():
    p = [np.cumprod([0.9] * K), np.cumprod([0.2] * K)]
    # drafting free: every drafted token is proposed
    assert choose_lengths(p, [K, K], CostModel(FREE)).lengths == [K, K]
    # caps (confidence cut) are respected
    assert choose_lengths(p, [2, 0], CostModel(FREE)).lengths == [2, 0]
    # drafting costs more than it can return: nothing
    c = choose_lengths(p, [K, K], CostModel(EXPENSIVE))
    assert c.lengths == [0, 0] and not c.speculate
    # a token costs 30% of a step: only tokens likely enough to be accepted
    mid = CostModel({"step_s": 0.01, "token_s": 0.003, "draft_s": 0.0})
    c = choose_lengths(p, [K, K], mid)
    assert c.speculate and c.lengths[1] == 0 and 0 < c.lengths[0] < K
    # the chosen set maximises the rate: one token more or less is not better
    def rate(lengths):
        tokens = 2 + sum(float(p[i][: lengths[i]].sum()) for i in range(2))
        return tokens / (0.01 + 0.003 * sum(lengths))
    best = rate(c.lengths)
    for d in (-1, 1):
        alt = [c.lengths[0] + d, 0]
        if 0 <= alt[0] <= K:
            assert rate(alt) <= best + 1e-12
    assert c.rate == pytest.approx(best)
    # min_gain: a marginal gain is not worth it
    small = [np.cumprod([0.05] * K)]
    cm = CostModel({"step_s": 0.01, "token_s": 0.0004, "draft_s": 0.0})
    assert choose_lengths(small, [K], cm, min_gain=0.0).speculate
    assert not choose_lengths(small, [K], cm, min_gain=0.5).speculate


def test_acceptance_running_mean_per_position():
    acc = AcceptanceStats(4, prior=0.5, strength=1.0, request_decay=0.5, global_decay=1.0)
    assert acc.alpha("a", "dlite") == [0.5] * 4
    acc.observe("a", "dlite", proposed=4, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 unseen
    g = acc.global_alpha("dlite")
    assert g[0] == g[1] == pytest.approx(0.75) and g[2] == pytest.approx(0.25) and g[3] == 0.5
    a = acc.alpha("a", "dlite")
    assert a[0] > g[0] and a[2] < g[2] and a[3] == pytest.approx(0.5)
    # a new request starts from the population's means; another source is separate
    assert acc.alpha("b", "dlite") == pytest.approx(g)
    assert acc.alpha("a", "suffix") == [0.5] * 4
    # the running mean follows recent rounds (decay 0.5)
    for _ in range(6):
        acc.observe("a", "dlite", proposed=4, accepted=0)
    assert acc.alpha("a", "dlite")[0] < 0.2
    p = acc.cumulative("a", "dlite")
    assert all(p[j + 1] <= p[j] for j in range(3))
    acc.forget("a")
    assert acc.alpha("a", "dlite") == pytest.approx(acc.global_alpha("dlite"))


def test_hybrid_source_choice():
    assert choose_source(0, 0.0, 1.0) == "dlite"  # no match
    assert choose_source(4, 2.0, 1.5) == "suffix"
    assert choose_source(1, 0.6, 1.5) == "dlite"  # a weak match loses to a confident DLite
    assert choose_source(2, 0.6, None) == "suffix"  # DLite did not draft this round
    assert expected_from_confidence([0.5, 0.5]) == pytest.approx(0.75)

    ctl = AdaptiveController(AdaptiveOptions.from_dict("hybrid", {"cost_model": FREE, "probe_every": 0,
                                                                  "suffix_skip_factor": 0.0}), K,
                             clock=lambda: 0.0)
    match = Match([5, 6, 7, 8], [0.9, 0.8, 0.7, 0.6], 3.0)
    plan = ctl.plan(["rep", "new"], K, [match, None])
    assert plan.dlite_rows == [0, 1] and plan.suffix == {0: match}
    unsure, sure = [0.3] * K, [0.99] * K  # DLite expects ~0.43 / ~6.7 accepted tokens
    assert ctl.select(plan, ["rep", "new"], K, {0: unsure, 1: unsure}) == ([4, K], ["suffix", "dlite"])
    assert ctl.select(plan, ["rep", "new"], K, {0: sure, 1: sure}) == ([K, K], ["dlite", "dlite"])


def test_hybrid_leaves_rows_to_the_tree_before_drafting():
    """A row whose tree score beats suffix_skip_factor x DLite's running expected accepted drafts
    takes the tree's draft without DLite drafting it; when every row does, DLite does not run and
    its on/off verdict stays as it was."""
    ctl = AdaptiveController(AdaptiveOptions.from_dict("hybrid", {"cost_model": FREE, "probe_every": 0}), K,
                             clock=lambda: 0.0)
    expected = sum(ctl.acceptance.cumulative("rep", "dlite")[:K])  # the prior's, ~1.4 at 0.6 per position
    strong = Match([5, 6, 7, 8], [0.9, 0.8, 0.7, 0.6], 1.6 * expected)
    weak = Match([5, 6], [0.9, 0.8], 1.4 * expected)
    plan = ctl.plan(["rep", "new"], K, [strong, weak])
    assert plan.phase == "decide" and plan.dlite_rows == [1] and set(plan.suffix) == {0, 1}
    lengths, sources = ctl.select(plan, ["rep", "new"], K, {1: [0.99] * K})
    assert sources == ["suffix", "dlite"] and lengths == [4, K]
    plan = ctl.plan(["rep", "new"], K, [strong, strong])
    assert plan.dlite_rows == [] and ctl.speculating
    assert ctl.select(plan, ["rep", "new"], K, {}) == ([4, 4], ["suffix", "suffix"])
    # the tree's drafts do not move DLite's running acceptance: the same rows skip again
    ctl.end_round(["rep", "new"], ["suffix", "suffix"], [4, 4], plan.phase, 0, None)
    ctl.begin_round(["rep", "new"], [4, 4], [5, 5], [0, 0])
    assert ctl.plan(["rep", "new"], K, [strong, strong]).dlite_rows == []
    with pytest.raises(ValueError, match="suffix_skip_factor"):
        AdaptiveOptions.from_dict("hybrid", {"suffix_skip_factor": -1})
    with pytest.raises(ValueError, match="suffix_skip_factor = '2': must be a number"):
        AdaptiveOptions.from_dict("hybrid", {"suffix_skip_factor": "2"})


def _round(ctl, req_ids, confidence, k=K, suffix=None):
    plan = ctl.plan(req_ids, k, suffix)
    conf = {i: confidence for i in plan.dlite_rows}
    lengths, sources = ctl.select(plan, req_ids, k, conf)
    ctl.end_round(req_ids, sources, lengths, plan.phase, len(plan.dlite_rows), 0.001 if plan.dlite_rows else None)
    return plan, lengths


def test_a_request_that_stopped_drafting_is_tried_again():
    """No draft, no evidence: a request whose drafts were rejected lets its own running acceptance
    fade while it proposes nothing, and drafts again once the population's says it pays."""
    cost = {"step_s": 0.01, "token_s": 0.001, "draft_s": 0.006}
    ctl = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"cost_model": cost, "probe_every": 0}), K)
    for _ in range(30):
        ctl.acceptance.observe("others", "dlite", K, K - 1)  # the population accepts most drafts
    for _ in range(8):
        ctl.acceptance.observe("a", "dlite", K, 0)  # "a" had a bad stretch
    plan, lengths = _round(ctl, ["a"], [0.99] * K)
    assert plan.dlite_rows == [] and lengths == [0]
    for rounds in range(1, 30):
        ctl.begin_round(["a"], [0], [1], None)  # a decode step without drafts
        plan, lengths = _round(ctl, ["a"], [0.99] * K)
        if plan.dlite_rows:
            break
    assert plan.dlite_rows == [0] and lengths[0] > 0 and rounds < 15, rounds


def test_controller_free_and_expensive_drafting_and_the_head_probabilities():
    opts = {"probe_every": 0, "prior_acceptance": 0.6}
    free = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"cost_model": FREE, **opts}), K)
    plan, lengths = _round(free, ["a", "b"], [0.9, 0.8, 0.5, 0.3])
    assert plan.phase == "decide" and lengths == [K, K]
    # a token costs 10% of a step: the head's probabilities (no evidence yet) say two tokens pay
    mid = AdaptiveController(AdaptiveOptions.from_dict(
        "adaptive", {"cost_model": {"step_s": 0.01, "token_s": 0.001, "draft_s": 0.0}, **opts}), K)
    assert _round(mid, ["a", "b"], [0.9, 0.8, 0.5, 0.3])[1] == [2, 2]
    # the head is unsure from the second token on: the draft is cut there
    assert _round(mid, ["a", "b"], [0.9, 0.05, 0.5, 0.3])[1] == [1, 1]

    dear = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"cost_model": EXPENSIVE, **opts}), K)
    plan, lengths = _round(dear, ["a", "b"], [0.99] * K)
    assert plan.dlite_rows == [] and lengths == [0, 0]  # the drafter does not even run


def test_an_unsure_head_whose_drafts_are_accepted_is_believed_by_evidence():
    """A drafter whose unsure tokens are accepted anyway (the tests' copy drafter) stops being cut
    once the verifications say so."""
    mid = {"step_s": 0.01, "token_s": 0.001, "draft_s": 0.0}
    ctl = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"cost_model": mid, "probe_every": 0}), K)
    unsure = [0.01] * K
    assert _round(ctl, ["a"], unsure)[1] == [0]
    for _ in range(20):  # whole drafts of unsure tokens keep being accepted (e.g. probe rounds)
        ctl._pending["a"] = ("dlite", K, unsure)
        ctl.begin_round(["a"], [K], [K + 1], [0])
    assert ctl.calibration.alpha([0.01])[0] > 0.8
    assert _round(ctl, ["a"], unsure)[1][0] >= 2


def test_controller_explores_then_probes_and_learns():
    """Online cost model: explore rounds alternate off/on, then one probe every ``probe_every``."""
    now = [0.0]
    ctl = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"explore_rounds": 4, "probe_every": 5}),
                             K, clock=lambda: now[0])
    phases = []
    scheduled = [0, 0]
    for r in range(12):
        # a step costs 10 ms + 1 ms per draft token verified + 0.5 ms per accepted one (emitted);
        # 1 to 3 drafts accepted per request: speculation pays
        rejected = [max(0, s - 1 - (r + i) % 3) for i, s in enumerate(scheduled)]
        now[0] += 0.010 + 0.001 * sum(scheduled) + 0.0005 * sum(s - j for s, j in zip(scheduled, rejected))
        ctl.begin_round(["a", "b"], scheduled, [1 + s for s in scheduled], rejected if any(scheduled) else None)
        plan, lengths = _round(ctl, ["a", "b"], [0.9] * K)
        phases.append(plan.phase)
        scheduled = lengths
        now[0] += 0.002
    assert phases[:4] == ["explore-off", "explore-on", "explore-off", "explore-on"]
    assert "probe-off" in phases and phases.count("decide") >= 5
    assert ctl.cost.ready and ctl.cost.token_seconds(2) == pytest.approx(0.001, rel=0.2)
    assert ctl.cost.accepted_seconds() == pytest.approx(0.0005, rel=0.3)
    assert ctl.speculating
    stats = ctl.stats()
    assert stats["totals"]["dlite"]["accepted"] > 0
    assert set(stats["requests"]) == {"a", "b"}
    ctl.begin_round(["b"], [0], [1], None, live_req_ids={"b"})  # "a" finished
    assert "a" in ctl.finished and "a" not in ctl.requests
    assert "dlite" in ctl.summary_line()


def test_explore_and_probe_rounds_draft_for_a_share_of_the_batch_in_turn():
    """What explore-on and probe-on rounds measure (the cost of verified drafts, the acceptance of
    the head's unsure tokens) needs drafts, not a whole batch of them: a quarter of the batch by
    default, at least one request, a different share each time."""
    req_ids = [f"r{i}" for i in range(8)]
    ctl = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"explore_rounds": 6}), K)
    drafted = []
    for _ in range(6):
        plan, lengths = _round(ctl, req_ids, [0.9] * K)
        if plan.phase == "explore-on":
            assert len(plan.dlite_rows) == 2 and lengths == [K if i in plan.dlite_rows else 0 for i in range(8)]
            drafted.append(tuple(plan.dlite_rows))
    assert len(drafted) == 3 and len(set(drafted)) == 3  # in turn
    one = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"explore_rounds": 2}), K)
    assert [len(_round(one, ["a"], [0.9] * K)[0].dlite_rows) for _ in range(2)] == [0, 1]
    everyone = AdaptiveController(AdaptiveOptions.from_dict("adaptive", {"explore_share": 1.0}), K)
    assert [len(_round(everyone, req_ids, [0.9] * K)[0].dlite_rows) for _ in range(2)] == [0, 8]
    with pytest.raises(ValueError, match="explore_share"):
        AdaptiveOptions.from_dict("adaptive", {"explore_share": 0})


# =========================================================================== engine (slow)
vllm = pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

NUM_PROMPTS = 12
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts():
    return H.make_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def baseline(models, prompts, greedy):
    return H.run_llm(models.target, prompts, greedy, max_num_seqs=4)


def spec(method, drafter, **options):
    return {"method": method, "model": str(drafter), "dlite_options": options}


def _run_job(target, prompts, params, speculative_config, record_plans: bool = False, kwargs: dict | None = None):
    """``H.run_llm`` plus the drafting counters (read before the engine goes) and, with
    ``record_plans``, every round's ``(req_ids, suffix drafts, Plan)``."""
    from vllm_dlite.vllm import adaptive

    ctl, decisions = [], []
    end_round, plan = adaptive.AdaptiveController.end_round, adaptive.AdaptiveController.plan

    def recording_end_round(self, *a, **kw):
        end_round(self, *a, **kw)
        ctl[:] = [self]

    def recording_plan(self, req_ids, k, suffix=None):
        out = plan(self, req_ids, k, suffix)
        decisions.append((list(req_ids), list(suffix or [None] * len(req_ids)), out))
        return out

    adaptive.AdaptiveController.end_round = recording_end_round
    if record_plans:
        adaptive.AdaptiveController.plan = recording_plan
    try:
        run = H.run_llm(target, prompts, params, speculative_config, **(kwargs or {}))
    finally:
        adaptive.AdaptiveController.end_round, adaptive.AdaptiveController.plan = end_round, plan
    return run, (ctl[0].stats() if ctl else None), decisions


def greedy_job(models, prompts, greedy, method):
    # the copy drafter's head is not confident (probabilities ~1/V): its drafts are proposed in the
    # explore rounds, and from then on as the calibration learns that they are accepted
    return prompts, greedy, spec(method, models.copy_drafter)


REPETITIVE, PLAIN = [132] * 12, list(range(40, 52))  # the second prompt: no token repeats


def sampled_job(models, method):
    import test_vllm_sampling as S

    params = SamplingParams(temperature=S.TEMPERATURE, max_tokens=4, ignore_eos=True)
    config = spec(method, models.copy_drafter, cost_model=FREE)
    config["draft_sample_method"] = "probabilistic"
    return [S.PROMPT] * S.NUM_REQUESTS, params, config, False, {"max_num_seqs": 128}


@pytest.mark.slow
@pytest.mark.v1  # dlite-adaptive / dlite-hybrid run on Model Runner V1 only
@pytest.mark.parametrize("method", ["dlite-adaptive", "dlite-hybrid"])
def test_greedy_identical_to_no_speculation(models, prompts, greedy, baseline, method):
    run, stats, _ = _run_job(models.target, *greedy_job(models, prompts, greedy, method))
    assert run.drafter_types == ["AdaptiveDLiteProposer"]
    assert run.token_ids == baseline.token_ids
    m = run.metrics
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    # the proposer's own counters agree with vLLM's
    totals = stats["totals"]
    assert sum(t["accepted"] for t in totals.values()) == m["vllm:spec_decode_num_accepted_tokens"]
    assert sum(t["proposed"] for t in totals.values()) == m["vllm:spec_decode_num_draft_tokens"]
    assert sum(t["rounds"] for t in totals.values()) == m["vllm:spec_decode_num_drafts"]
    assert run.num_gpu_blocks == baseline.num_gpu_blocks  # still no draft KV cache


@pytest.mark.slow
@pytest.mark.v1  # dlite-adaptive / dlite-hybrid run on Model Runner V1 only
def test_adaptive_proposes_nothing_when_drafting_cannot_pay_and_k_when_it_does(models, prompts, greedy, baseline,
                                                                              monkeypatch):
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from vllm_dlite.vllm.adaptive.proposer import AdaptiveDLiteProposer

    calls = {"propose": 0, "verify nothing": 0}
    propose, verify = AdaptiveDLiteProposer.propose, RejectionSampler.forward

    def counted_propose(self, *a, **kw):
        calls["propose"] += 1
        return propose(self, *a, **kw)

    def counted_verify(self, metadata, *a, **kw):
        calls["verify nothing"] += metadata.max_spec_len == 0
        return verify(self, metadata, *a, **kw)

    monkeypatch.setattr(AdaptiveDLiteProposer, "propose", counted_propose)
    monkeypatch.setattr(RejectionSampler, "forward", counted_verify)
    sub = prompts[:8]
    run, stats, _ = _run_job(models.target, sub, greedy, spec("dlite-adaptive", models.copy_drafter,
                                                             cost_model=EXPENSIVE, probe_every=0))
    assert run.token_ids == baseline.token_ids[:8]
    assert run.metrics.get("vllm:spec_decode_num_drafts", 0) == 0
    assert stats["rounds"] > 0 and stats["totals"]["dlite"]["proposed"] == 0
    # rounds in which nobody drafts end before vLLM prepares the drafter (propose never runs), and
    # steps with nothing to verify are sampled as without speculation (no rejection sampler)
    assert calls == {"propose": 0, "verify nothing": 0}

    run, stats, _ = _run_job(models.target, sub, greedy, spec("dlite-adaptive", models.copy_drafter,
                                                             cost_model=FREE))
    assert run.token_ids == baseline.token_ids[:8]
    m = run.metrics
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == m["vllm:spec_decode_num_drafts"] * K
    assert calls["propose"] > 0


@pytest.mark.slow
@pytest.mark.v1  # dlite-adaptive / dlite-hybrid run on Model Runner V1 only
def test_hybrid_uses_the_suffix_tree_on_repetitive_context_and_dlite_otherwise(models):
    """A prompt repeating one token (the tiny target keeps repeating it) is drafted by the suffix
    tree, whose score beats the random drafter's unsure head; a prompt without repeats has no match
    at first and is drafted by DLite (free drafting, and ``suffix_skip_factor`` 0: DLite drafts
    every row, and the choice is made on its head probabilities)."""
    prompts = [{"prompt_token_ids": REPETITIVE}, {"prompt_token_ids": PLAIN}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = H.run_llm(models.target, prompts, params, max_num_seqs=2)
    run, stats, decisions = _run_job(models.target, prompts, params, spec(
        "dlite-hybrid", models.drafter, cost_model=FREE, suffix_skip_factor=0.0), record_plans=True)
    assert run.token_ids == base.token_ids
    rep, new = (stats["requests"][r] for r in decisions[0][0])
    assert rep["suffix"]["rounds"] > 0 and rep["suffix"]["accepted"] > 0, stats["requests"]
    assert new["dlite"]["rounds"] > 0, stats["requests"]
    first_plain = next(d for d in decisions if len(d[0]) == 2)
    assert first_plain[1][1] is None and 1 not in first_plain[2].suffix and 1 in first_plain[2].dlite_rows
    for req_ids, matches, p in decisions:
        assert p.dlite_rows == list(range(len(req_ids)))  # free drafting: DLite drafts every row
        assert set(p.suffix) == {i for i, m in enumerate(matches) if m}
    assert any(p.suffix for _, _, p in decisions)


@pytest.mark.slow
@pytest.mark.v1  # dlite-adaptive / dlite-hybrid run on Model Runner V1 only
@pytest.mark.parametrize("method", ["dlite-adaptive", "dlite-hybrid"])
def test_sampled_distribution_equals_target(models, method):
    """As ``test_vllm_sampling.py``: the joint of the first two sampled tokens over 2,000 requests
    matches the target's exact distribution (chi-square, alpha 1e-3), probabilistic drafts."""
    import test_vllm_sampling as S

    from transformers import AutoTokenizer

    model = H._hf_model(str(models.target))
    ids = AutoTokenizer.from_pretrained(str(models.target)).encode(S.PROMPT)
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / S.TEMPERATURE, -1)
        batch = torch.tensor([ids + [y] for y in range(p1.numel())])
        p2 = torch.softmax(model(batch).logits[:, -1].double() / S.TEMPERATURE, -1)
    joint = p1[:, None] * p2
    run, _, _ = _run_job(models.target, *sampled_job(models, method))
    counts = collections.Counter(t[0] * H.TARGET_VOCAB + t[1] for t in run.token_ids)
    p, dof = S.chi_square_p_value(counts, joint, S.NUM_REQUESTS)
    print(f"{method}: chi2 p={p:.3g}, dof={dof}, accepted={run.metrics['vllm:spec_decode_num_accepted_tokens']}")
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert p > S.ALPHA, f"sampled (y1, y2) differ from the target's distribution: p={p:.2e}"


def _counters_from_engine_process(target, drafter, prompts, greedy) -> tuple[dict | None, dict]:
    """``collect_stats`` with the engine core in its own process (vLLM's default outside tests), and
    vLLM's own spec-decode counters of the same run."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    H.apply_vllm_env()
    from vllm_dlite.vllm.adaptive import collect_stats
    from vllm_dlite.vllm.engine import build_llm, shutdown
    from vllm_dlite.vllm.plugin import register

    register()
    # the measured cost model (numpy figures in the counters: they must cross the process boundary)
    llm = build_llm(target, spec("dlite-adaptive", drafter, explore_rounds=8),
                    max_model_len=256, max_num_seqs=4, enforce_eager=True)
    llm.generate(prompts, greedy, use_tqdm=False)
    metrics = H.read_metrics(llm)
    stats = collect_stats(llm)
    shutdown(llm)
    return stats, metrics


@pytest.mark.slow
@pytest.mark.v1  # dlite-adaptive / dlite-hybrid run on Model Runner V1 only
def test_counters_are_read_from_an_engine_in_its_own_process(models, prompts, greedy):
    """``collect_stats`` asks the workers by method name (``collective_rpc("dlite_drafting_stats")``),
    which works across processes; a function would need vLLM's insecure serialization."""
    from lab.harness.processes import in_fresh_process

    stats, metrics = in_fresh_process(_counters_from_engine_process, str(models.target), str(models.copy_drafter),
                                      prompts[:4], greedy)
    assert stats is not None and stats["mode"] == "adaptive" and stats["rounds"] > 0
    assert stats["cost_model"] and stats["rounds_by_phase"]
    assert stats["totals"]["dlite"]["accepted"] == metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert stats["totals"]["dlite"]["proposed"] == metrics.get("vllm:spec_decode_num_draft_tokens", 0)
