"""The OpenAI server with DLite under load, client aborts, preemption, bad input and corrupted
drafter checkpoints: ``benchmarks/serve_load.py`` on the shipped tiny models (loopback, CPU).

Smaller than the benchmark's defaults so the suite stays short (64 concurrent streamed requests
with tools per round, prompts up to the 1,024-token context, 25% aborted, a KV pool with room for two
max-length requests that admits requests by their first prefill chunk, a warm-up and two measured
rounds; servers in eager mode, ``--enforce-eager``: compilation would add ~25-45 s to each start-up
and changes nothing checked here; ``--overlap-startup``: the DLite server and the corrupted-checkpoint
start-up launch while the reference server runs), same checks:

* every completed stream equals the greedy reply of a server without speculation, token for token,
  and every aborted stream is a prefix of it; no 5xx; the server stays up; vLLM preempted;
* after each round no request is left running or waiting and the KV cache is empty;
* resident memory of the server's process tree grows < 5% after the warm-up round;
* empty messages, an invalid tool schema, a huge max_tokens, a prompt over the context limit and a
  non-JSON body get the same status and error type as without speculation, and the server answers
  a good request afterwards;
* a truncated drafter checkpoint makes ``vllm serve`` exit non-zero at start-up with an error
  naming the file (missing tensor, wrong dtype, wrong shape: the same check, in
  ``test_vllm_integration.test_bad_config_errors``; all four through ``vllm serve`` in the benchmark).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paths import DRAFTER_DIR, REPO  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DRAFTER_DIR / "model.safetensors").exists(), reason="no shipped drafter"),
]

ABORT = 0.25
# concurrent requests and measured rounds per runner: V2 runs through Triton's interpreter here (slow),
# so fewer requests; each round still preempts (the KV pool holds two max-length requests)
SIZES = {"v1": (64, 2), "v2": (16, 2)}


@pytest.fixture(scope="module")
def report(tmp_path_factory, runner):
    requests, rounds = SIZES[runner]
    out = tmp_path_factory.mktemp(f"serve-load-{runner}")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/serve_load.py"), "--out", str(out),
                           "--requests", str(requests), "--rounds", str(rounds), "--abort-fraction", str(ABORT),
                           "--max-model-len", "1024", "--max-tokens", "24", "--corrupt", "truncated",
                           "--enforce-eager", "--overlap-startup", "--runner", runner],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    results = out / "results.json"
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(results.read_text())
    data["_returncode"], data["_stdout"] = proc.returncode, proc.stdout[-3000:]
    return data


def test_no_mismatch_no_5xx_server_up(report):
    """Compares the raw streams itself: every completed stream equals the reference server's reply
    token for token, every aborted one is a prefix of it, and nothing else came back."""
    load, reference = report["load"], report["reference"]["token_ids"]
    requests, rounds = report["settings"]["requests"], report["settings"]["rounds"]
    assert (requests, rounds) == SIZES[report["settings"]["runner"]]
    assert len(reference) == requests and all(reference), "the reference server did not answer every request"
    assert len(load["rounds"]) == rounds + 1
    for r in load["rounds"]:
        assert r["alive"]
        outs = r["outputs"]
        assert len(outs) == requests
        aborted = [i for i, o in enumerate(outs) if o["aborted"]]
        assert len(aborted) >= 0.2 * requests
        for i, (o, want) in enumerate(zip(outs, reference)):
            assert o["status"] == 200 and o["error"] is None, (r["round"], i, o["status"], o["error"])
            if o["aborted"]:
                assert o["token_ids"] == want[: len(o["token_ids"])], (r["round"], i, "aborted stream not a prefix")
            else:
                assert o["finish_reason"] is not None and o["token_ids"] == want, (r["round"], i)
    assert report["settings"]["enforce_eager"] and report["settings"]["overlap_startup"]
    assert max(report["settings"]["prompt_tokens"]) + report["settings"]["max_tokens"] > 0.9 * 1024
    assert load["preemptions"] > 0, "the KV pool did not force preemption"
    assert load["spec_decode"]["vllm:spec_decode_num_drafts_total"] > 0


def test_requests_freed_and_memory_flat(report):
    for r in report["load"]["rounds"]:
        g = r["idle_gauges"]
        assert g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0 and g["kv_cache_usage_perc"] == 0
    warm, last = report["load"]["rounds"][0]["rss_bytes_end"], report["load"]["rounds"][-1]["rss_bytes_end"]
    assert last / warm - 1 < 0.05


def test_bad_input_gets_vllms_normal_errors(report):
    bad = report["bad_input"]
    for name in ("empty_messages", "invalid_tool_schema", "huge_max_tokens", "prompt_over_context", "not_json"):
        b = bad[name]
        assert (b["dlite_status"], b["dlite_type"]) == (b["reference_status"], b["reference_type"]), b
        assert 400 <= b["dlite_status"] < 500, b
    after = bad["served_after"]
    assert after["alive"] and after["status"] == 200
    assert after["token_ids"] == report["reference"]["token_ids"][0]


def test_corrupted_checkpoint_fails_startup_naming_the_file(report):
    corrupt = report["corrupt_checkpoint"]
    assert set(corrupt) == {"truncated"}
    for how, c in corrupt.items():
        assert c["returncode"] not in (0, None), (how, c["returncode"])
        named = [ln for ln in c["log_tail"].splitlines() if c["file"] in ln and "rror" in ln]
        assert named, (how, c["log_tail"][-1500:])


def test_no_failures_reported(report):
    assert report["failures"] == [] and report["_returncode"] == 0, report["_stdout"]
