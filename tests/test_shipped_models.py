"""The shipped tiny target + DLite drafter in vLLM (CPU, fp32): lossless, tau as estimated
offline, no draft KV, and the OpenAI server with ``/metrics``.

* greedy replies to held-out agentic and code turns are identical token for token with and without
  DLite (K = 7);
* vLLM's tau (``1 + accepted / drafts`` from its spec-decode counters) agrees with the offline
  estimator (``vllm_dlite.eval.offline``: HF target, one request at a time) within 5% on the same
  prompts and lengths;
* the KV pool with DLite equals the pool without speculation;
* ``examples/serve_dlite.py`` starts ``vllm serve`` with ``--speculative-config``, gets a chat
  completion with tools and reads the spec-decode counters from ``/metrics``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_vllm as H  # noqa: E402
from paths import DRAFTER_DIR, REPO, TARGET_DIR, WORKLOADS  # noqa: E402

H.apply_vllm_env()
torch.set_num_threads(1)
vllm = pytest.importorskip("vllm")

K = 7
MAX_TOKENS = 48
MAX_PROMPT_TOKENS = 3072
REQUESTS_PER_KIND = 6

pytestmark = pytest.mark.skipif(not (DRAFTER_DIR / "model.safetensors").exists(),
                                reason="no shipped drafter (models/dlite-qwen3-tiny-stdlib)")


@pytest.fixture(scope="module")
def requests():
    from transformers import AutoTokenizer

    from vllm_dlite.eval.offline import load_requests

    tok = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    return load_requests(tok, [str(WORKLOADS / "heldout_agentic.jsonl"), str(WORKLOADS / "heldout_code.jsonl")],
                         max_prompt_tokens=MAX_PROMPT_TOKENS, max_requests_per_kind=REQUESTS_PER_KIND)


@pytest.fixture(scope="module")
def vllm_runs(requests):
    from vllm_dlite.vllm.replay_engine import build_llm, run_replay, shutdown, speculative_config

    prompts = [r.prompt_token_ids for r in requests]
    runs = {}
    for method in ("none", "dlite"):
        llm = build_llm(TARGET_DIR, speculative_config(method, K, DRAFTER_DIR), max_model_len=4096,
                        max_num_seqs=4, enforce_eager=True)
        runs[method] = run_replay(llm, method, prompts, max_tokens=MAX_TOKENS)
        shutdown(llm)
    return runs


@pytest.mark.slow
def test_lossless_greedy_on_agentic_and_code_turns(requests, vllm_runs):
    kinds = {r.kind for r in requests}
    assert kinds == {"agentic", "code"} and len(requests) == 2 * REQUESTS_PER_KIND
    for req, base, spec in zip(requests, vllm_runs["none"].outputs, vllm_runs["dlite"].outputs):
        assert spec == base, f"{req.session_id}#{req.turn}: DLite changed the greedy output"
    assert vllm_runs["dlite"].num_drafts > 0


@pytest.mark.slow
def test_no_draft_kv_cache(vllm_runs):
    assert vllm_runs["dlite"].kv_pool_tokens == vllm_runs["none"].kv_pool_tokens > 0


@pytest.mark.slow
def test_vllm_tau_matches_offline_estimator(requests, vllm_runs):
    from vllm_dlite.eval.offline import SpeculativeSimulator, TargetFeatureExtractor
    from vllm_dlite.model import load_drafter

    drafter = load_drafter(str(DRAFTER_DIR), dtype=torch.float32)
    extractor = TargetFeatureExtractor.from_pretrained(str(TARGET_DIR), drafter.config.target_layer_ids,
                                                       dtype=torch.float32)
    drafter.bind_target(extractor.embed_weight, extractor.lm_head_weight)
    sim = SpeculativeSimulator(extractor, drafter, K)
    rounds = accepted = 0
    for req, base in zip(requests, vllm_runs["none"].outputs):
        res = sim.generate(req.prompt_token_ids, MAX_TOKENS, req.session_id, req.kind)
        assert res.output_ids == base, "offline simulation is not the target's greedy output"
        rounds += res.rounds
        accepted += sum(res.accepted)
    tau_offline = 1 + accepted / rounds
    tau_vllm = vllm_runs["dlite"].tau
    print(f"tau vLLM {tau_vllm:.4f} ({vllm_runs['dlite'].num_drafts} drafts), offline {tau_offline:.4f} "
          f"({rounds} rounds), per-position vLLM {[round(x, 3) for x in vllm_runs['dlite'].tau_per_position]}")
    assert abs(tau_vllm - tau_offline) <= 0.05 * tau_offline, (tau_vllm, tau_offline)


@pytest.mark.slow
def test_serve_example_reports_spec_decode_metrics(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(REPO / "examples/serve_dlite.py"), "--max-tokens", "48",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["usage"]["completion_tokens"] > 0
    assert report["content"] or report["tool_calls"]
    for call in report["tool_calls"]:
        json.loads(call["arguments"])
    counters = report["spec_decode"]
    assert counters["vllm:spec_decode_num_drafts_total"] > 0
    assert "vllm:spec_decode_num_accepted_tokens_total" in counters
