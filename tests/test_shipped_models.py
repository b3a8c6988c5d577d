"""The shipped tiny target + DLite drafter in vLLM (CPU, fp32): lossless, tau as estimated
offline, no draft KV, and the OpenAI server with ``/metrics``.

* greedy replies to held-out agentic and code turns are identical token for token with and without
  DLite (K = 7);
* vLLM's tau (``1 + accepted / drafts`` from its spec-decode counters) agrees with the offline
  estimator (``vllm_dlite.train.offline_eval``: HF target, one request at a time) within 5% on the same
  prompts and lengths;
* the KV pool with DLite equals the pool without speculation;
* each on Model Runner V1 and V2 (``runner``, ``conftest.py``), and V2 makes the same drafts and
  acceptances as V1 on the same turns.

The serve example (``vllm serve`` with ``--speculative-config``, a chat completion with tools,
``/metrics``) runs in ``test_tensor_parallel.py`` with the target on two workers, and the server
under load in ``test_serving_faults.py``.
"""

from __future__ import annotations


import os

import pytest
import torch

import helpers_vllm as H
from paths import DRAFTER_DIR, TARGET_DIR

H.apply_vllm_env()
torch.set_num_threads(1)
vllm = pytest.importorskip("vllm")

from conftest import (SHIPPED_K as K, SHIPPED_MAX_TOKENS as MAX_TOKENS,
                      SHIPPED_REQUESTS_PER_KIND as REQUESTS_PER_KIND)

pytestmark = pytest.mark.skipif(not (DRAFTER_DIR / "model.safetensors").exists(),
                                reason="no shipped drafter (models/dlite-qwen3-tiny-stdlib)")


@pytest.mark.slow
def test_lossless_greedy_on_agentic_and_code_turns(shipped_requests, shipped_replays, runner):
    kinds = [r.kind for r in shipped_requests]
    assert sorted(kinds) == ["agentic"] * REQUESTS_PER_KIND + ["code"] * REQUESTS_PER_KIND
    runs = shipped_replays
    assert runs["none"]["runner"] == runs["dlite"]["runner"] == runner
    for req, base, spec in zip(shipped_requests, runs["none"]["outputs"], runs["dlite"]["outputs"]):
        assert spec == base, f"{req.session_id}#{req.turn}: DLite changed the greedy output"
    assert runs["dlite"]["summary"]["num_drafts"] > 0


@pytest.mark.slow
def test_no_draft_kv_cache(shipped_replays):
    dlite, none = shipped_replays["dlite"]["summary"], shipped_replays["none"]["summary"]
    assert dlite["kv_pool_tokens"] == none["kv_pool_tokens"] > 0


@pytest.mark.slow
def test_vllm_tau_matches_offline_estimator(shipped_requests, shipped_replays):
    from vllm_dlite.train.offline_eval import build_simulator

    # the drafter (dlite_v1) reads the vLLM aux ids config.aux_layer_ids and x_{a-G+1..a}
    sim = build_simulator(str(TARGET_DIR), str(DRAFTER_DIR), K, dtype=torch.float32)
    rounds = accepted = 0
    for req, base in zip(shipped_requests, shipped_replays["none"]["outputs"]):
        res = sim.generate(req.prompt_token_ids, MAX_TOKENS, req.session_id, req.kind)
        assert res.output_ids == base, "offline simulation is not the target's greedy output"
        rounds += res.rounds
        accepted += sum(res.accepted)
    tau_offline = 1 + accepted / rounds
    dlite = shipped_replays["dlite"]["summary"]
    tau_vllm = dlite["tau"]
    print(f"tau vLLM {tau_vllm:.4f} ({dlite['num_drafts']} drafts), offline {tau_offline:.4f} "
          f"({rounds} rounds), per-position vLLM {[round(x, 3) for x in dlite['tau_per_position']]}")
    assert abs(tau_vllm - tau_offline) <= 0.05 * tau_offline, (tau_vllm, tau_offline)


@pytest.mark.slow
@pytest.mark.v1
def test_v2_drafts_and_accepts_as_v1(shipped_requests):
    """Greedy: both runners verify the same drafts (the drafter sees the same features and tokens),
    so the draft count, accepted tokens per position and tau are the same on V1 and V2."""
    from conftest import shipped_replays_on

    v1 = shipped_replays_on("v1", shipped_requests)["dlite"]
    v2 = shipped_replays_on("v2", shipped_requests)["dlite"]
    assert (v1["runner"], v2["runner"]) == ("v1", "v2")
    assert v2["outputs"] == v1["outputs"]
    one, two = v1["summary"], v2["summary"]
    print(f"tau V1 {one['tau']:.4f} ({one['num_drafts']} drafts), V2 {two['tau']:.4f} ({two['num_drafts']} drafts)")
    assert (two["num_drafts"], two["accepted_tokens"]) == (one["num_drafts"], one["accepted_tokens"])
    assert two["tau_per_position"] == pytest.approx(one["tau_per_position"], abs=1e-12)


@pytest.mark.slow
def test_tau_equals_that_of_vllm_032_v2(shipped_requests, shipped_replays, runner):
    """Under vLLM 0.34 (``make test-vllm034``): the shipped drafter makes the same drafts and the
    target accepts the same tokens as on vLLM 0.32's Model Runner V2 (``.venv``) on the same turns,
    so the plugin's 0.34 path (the speculator registry and compat's adapters) serves DLite as 0.32's does."""
    import json
    import subprocess

    import vllm

    from paths import REPO

    if not vllm.__version__.startswith("0.34") or runner != "v2":
        pytest.skip("compares vLLM 0.34's V2 against 0.32's (make test-vllm034)")
    python032 = REPO / ".venv" / "bin" / "python"
    if not python032.exists():
        pytest.skip("no .venv (vLLM 0.32): make setup")
    code = ("import json, sys; sys.path[:0] = ['tests', '.']\n"
            "from conftest import load_shipped_requests, replay_shipped\n"
            "run = replay_shipped([r.prompt_token_ids for r in load_shipped_requests()], 'dlite', 1, 'v2')\n"
            "print('RESULT ' + json.dumps({'outputs': run['outputs'], 'summary': run['summary']}))")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET", "PYTHONPATH")}
    proc = subprocess.run([str(python032), "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    old = json.loads(lines[-1].removeprefix("RESULT "))
    new = shipped_replays["dlite"]
    one, two = old["summary"], new["summary"]
    print(f"tau vLLM 0.32 V2 {one['tau']:.4f} ({one['num_drafts']} drafts), "
          f"0.34 V2 {two['tau']:.4f} ({two['num_drafts']} drafts)")
    assert new["outputs"] == old["outputs"]
    assert (two["num_drafts"], two["accepted_tokens"]) == (one["num_drafts"], one["accepted_tokens"])
    assert two["tau_per_position"] == pytest.approx(one["tau_per_position"], abs=1e-12)
