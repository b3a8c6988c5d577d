"""DLite with the target sharded over two tensor-parallel workers (vLLM's CPU backend, each rank
pinned to its own core: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``, set by the engine builder).

Shipped tiny target + DLite drafter, fp32, K = 7, greedy, the 16 held-out turns of
``conftest.shipped_requests`` (8 agentic, 8 code); the TP=1 runs are ``conftest.shipped_replays``:

* greedy outputs with TP=2 + DLite equal TP=1 without speculation, token for token;
* every rank drafts alone from the all-reduced (full-width) aux hidden states and a full copy of
  the vocabulary-parallel embedding / lm_head, so TP=2 drafts as TP=1 does: same number of drafts,
  same accepted tokens per position, hence the same tau;
* ``examples/serve_dlite.py --tensor-parallel-size 2 --enforce-eager``: ``vllm serve`` with DLite
  answers a chat completion with tools (valid JSON arguments) and counts drafts in ``/metrics``
  (eager: compilation would add ~25-45 s to the start-up; the compiled TP=2 model is the engine above).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import SHIPPED_REQUESTS_PER_KIND, replay_shipped  # noqa: E402
from lab.harness.runners import available_runners, runner_env
from paths import DRAFTER_DIR, REPO  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DRAFTER_DIR / "model.safetensors").exists(), reason="no shipped drafter"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on CPU needs two cores"),
]


@pytest.fixture(scope="module")
def tp2_dlite(shipped_requests, shipped_replays, runner):
    return replay_shipped([r.prompt_token_ids for r in shipped_requests], "dlite", tensor_parallel_size=2,
                          runner=runner)


def test_tp2_dlite_equals_tp1_without_speculation(shipped_requests, shipped_replays, tp2_dlite):
    assert [r.kind for r in shipped_requests].count("agentic") == SHIPPED_REQUESTS_PER_KIND
    base = shipped_replays["none"]["outputs"]
    assert len(base) == len(tp2_dlite["outputs"]) >= 16
    for req, a, b in zip(shipped_requests, base, tp2_dlite["outputs"]):
        assert b == a, f"{req.session_id}#{req.turn}: TP=2 with DLite changed the greedy output"
    assert tp2_dlite["summary"]["num_drafts"] > 0 and tp2_dlite["runner"] == shipped_replays["none"]["runner"]


def test_tp2_tau_equals_tp1_tau(shipped_replays, tp2_dlite):
    one, two = shipped_replays["dlite"]["summary"], tp2_dlite["summary"]
    print(f"tau TP=1 {one['tau']:.4f} ({one['num_drafts']} drafts, {one['output_tokens_per_s']:.1f} tok/s), "
          f"TP=2 {two['tau']:.4f} ({two['num_drafts']} drafts, {two['output_tokens_per_s']:.1f} tok/s)")
    assert (two["num_drafts"], two["accepted_tokens"]) == (one["num_drafts"], one["accepted_tokens"])
    assert two["tau_per_position"] == pytest.approx(one["tau_per_position"], abs=1e-12)


@pytest.mark.parametrize("runner", [available_runners()[0]])  # the serve example: one runner is enough
def test_serve_with_tensor_parallel_2(tmp_path, runner):
    out = tmp_path / "serve.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **runner_env(runner)}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the example pins one core per rank itself
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by other tests' engines; a server runs its core apart
    proc = subprocess.run([sys.executable, str(REPO / "examples/serve_dlite.py"), "--tensor-parallel-size", "2",
                           "--enforce-eager", "--max-tokens", "32", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "--tensor-parallel-size" in report["command"] and "--enforce-eager" in report["command"]
    assert report["usage"]["completion_tokens"] > 0
    assert report["content"] or report["tool_calls"]
    for call in report["tool_calls"]:
        json.loads(call["arguments"])
    counters = report["spec_decode"]
    assert counters["vllm:spec_decode_num_drafts_total"] > 0
    assert "vllm:spec_decode_num_accepted_tokens_total" in counters
