"""DLite on vLLM's Model Runner V2 on a CUDA GPU: lossless, eager and with CUDA graphs (``@pytest.mark.gpu``;
skipped without CUDA or vLLM). Stage b of ``benchmarks/gpu_check.py`` runs :func:`lossless_record`
from here (the GPU machine may lack pytest: this module imports without it).

The shipped tiny target ``models/qwen3-tiny-stdlib`` + DLite ``models/dlite-qwen3-tiny-stdlib``, fp32
(exact comparisons; bf16 if fp32 cannot be served, recorded): greedy outputs with DLite == without
speculation on 32 held-out agentic prompts (``vllm_dlite.train.offline_eval.load_requests``) at max
batch 16, eager AND with CUDA graphs (full graphs of the uniform decode/verify steps without
torch.compile, ``benchmarks/ab.py``'s ``COMPILE_MODES["none"]``, unless ``compile_mode="vllm"``); the
DLite speculator in the runner; drafts made and accepted; no draft KV (the KV pool equals that of no
speculation); probabilistic drafts (``draft_sample_method=probabilistic``) in a mixed greedy/sampled
batch (greedy rows identical, sampled rows complete). If the shipped drafter cannot be loaded (e.g.
it is being retrained in another format) the same checks run on random tiny models with a "copy"
drafter (``helpers_vllm.tiny_models``) and the reason is recorded. Every engine is one
``helpers_vllm.run_llm`` call; one that fails in this process is retried once in a fresh one.

What only a GPU can check of the V2 speculator's CUDA-graph path (the rest is tested on CPU in
``tests/test_vllm_integration.py::test_v2_graph_step_over_static_buffers``): the capture itself into
vLLM's global graph pool, replay on the device, vLLM's cudagraph memory profiling discarding
``_DLiteGraphs``, and that graph replays stay lossless.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from paths import DRAFTER_DIR, REPO, TARGET_DIR, WORKLOADS

try:
    import pytest
except ImportError:  # benchmarks/gpu_check.py on the GPU machine: lossless_record() only
    pytest = None

# "none": no torch.compile, full CUDA graphs of the uniform decode/verify steps (= benchmarks/ab.py
# COMPILE_MODES; copied, not imported: ab.py sets up a CPU environment when imported)
COMPILE_MODES = {"vllm": None, "none": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


def held_out_prompts(kind: str, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """``n`` held-out turns of ``kind`` (agentic / code; evenly spread over the file), rendered with
    the target's chat template."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.offline_eval import load_requests

    tok = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    reqs = load_requests(tok, [str(WORKLOADS / f"heldout_{kind}.jsonl")], max_prompt_tokens=max_prompt_tokens,
                         max_requests_per_kind=n)
    return [r.prompt_token_ids for r in reqs]


def drafter_problem(path: Path = DRAFTER_DIR) -> Optional[str]:
    """Why a DLite checkpoint cannot be served (None: its config is a valid dlite_v1 config)."""
    from vllm_dlite.config import DLiteConfig

    try:
        DLiteConfig.from_checkpoint_config(json.loads((path / "config.json").read_text()))
        return None if (path / "model.safetensors").exists() else "no model.safetensors"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def lossless_record(on_gpu: bool, *, num_prompts: int = 32, batch: int = 16, max_tokens: int = 48,
                    max_prompt_tokens: int = 6144, dtype: str = "float32", compile_mode: str = "none",
                    save: Callable[[], None] = lambda: None, rec: Optional[dict] = None) -> dict:
    """Run the engines and the checks; returns (and fills) ``rec``: ``models``, ``runs`` (per engine:
    runner version, speculator, drafts, accepted, tau, KV blocks, dtype, wall), ``checks`` (name, ok,
    detail), ``model_runner``, ``speculator``, ``lossless_greedy``, ``cuda_graphs`` (True when the
    graph run was lossless). Eager only when ``on_gpu`` is False (``--cpu-smoke``: V1 runner)."""
    import helpers_vllm as H
    from vllm import SamplingParams

    from lab.harness.runners import call_with_runner, current_runner
    from vllm_dlite.vllm.engine import speculative_config

    rec = {} if rec is None else rec
    problem = drafter_problem()
    if problem is None:
        target, drafter = TARGET_DIR, DRAFTER_DIR
        prompts = held_out_prompts("agentic", num_prompts, max_prompt_tokens)
        k = json.loads((drafter / "config.json").read_text())["block_size"] - 1
        rec["models"] = dict(target=str(target.relative_to(REPO)), drafter=str(drafter.relative_to(REPO)),
                             prompts="held-out agentic turns", k=k)
    else:
        from transformers import AutoTokenizer

        models = H.tiny_models(Path(tempfile.mkdtemp(prefix="gpu-check-tiny-")))
        target, drafter, k = models.target, models.copy_drafter, H.BLOCK_K
        tok = AutoTokenizer.from_pretrained(str(target))
        prompts = [tok(p)["input_ids"] for p in H.make_prompts(num_prompts)]
        rec["models"] = dict(target="random tiny Qwen3 (tests/helpers_vllm.py)", drafter="random copy drafter",
                             prompts=f"{num_prompts} short prompts", k=k,
                             why=f"shipped drafter {DRAFTER_DIR.relative_to(REPO)} unusable: {problem}")
    rec.update(num_prompts=len(prompts), graphs_compile=f"{compile_mode}: {COMPILE_MODES[compile_mode] or 'vLLM default'}",
               prompt_tokens=dict(min=min(map(len, prompts)), max=max(map(len, prompts))))
    spec = speculative_config("dlite", k, drafter)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runner = current_runner()
    runs, checks = rec.setdefault("runs", {}), rec.setdefault("checks", [])

    def check(name, ok, detail=""):
        checks.append(dict(name=name, ok=bool(ok), detail=detail))
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
        save()

    def run(name, sp, eager, params=greedy):
        kw = dict(dtype=rec.get("dtype", dtype), max_model_len=max(map(len, prompts)) + max_tokens + 16,
                  max_num_seqs=batch, enforce_eager=eager)
        if on_gpu:
            kw["gpu_memory_utilization"] = 0.15
            if not eager and COMPILE_MODES[compile_mode] is not None:
                kw["compilation_config"] = dict(COMPILE_MODES[compile_mode])
        t0, note = time.perf_counter(), None
        try:
            r = H.run_llm(target, token_prompts, params, sp, runner=runner, **kw)
        except Exception as exc:  # noqa: BLE001
            if kw["dtype"] == "float32" and not runs:  # the first engine: fp32 may not be served here
                rec["dtype_fallback"] = f"float32 failed ({exc!r:.300}); bf16 instead (exact identity not guaranteed)"
                rec["dtype"] = kw["dtype"] = "bfloat16"
                r = H.run_llm(target, token_prompts, params, sp, runner=runner, **kw)
            else:  # one retry in a fresh process (state left by earlier engines)
                note = f"in-process engine failed ({exc!r:.300}); ran in a fresh process"
                print(f"  {name}: {note}", flush=True)
                r = call_with_runner(runner, "helpers_vllm:run_llm", target, token_prompts, params, sp,
                                     runner=runner, **kw)
        m = r.metrics
        drafts, accepted = int(m.get("vllm:spec_decode_num_drafts", 0)), int(m.get("vllm:spec_decode_num_accepted_tokens", 0))
        kind = r.drafter_types[0] if r.drafter_types else None
        runs[name] = dict(version=r.runner, speculator=None if kind in (None, "NoneType") else kind,
                          dtype=kw["dtype"], drafts=drafts, accepted=accepted,
                          tau=round(1 + accepted / drafts, 3) if drafts else None, kv_blocks=r.num_gpu_blocks,
                          wall_s=round(time.perf_counter() - t0, 1), **({"note": note} if note else {}))
        print(f"  {name}: {runs[name]}", flush=True)
        save()
        return r

    identical: dict[str, bool] = {}
    base: dict = {}
    modes = [("eager", True), ("cuda_graphs", False)] if on_gpu else [("eager", True)]
    for mode, eager in modes:
        try:
            base[mode] = run(f"none/{mode}", None, eager)
            r = run(f"dlite/{mode}", spec, eager)
        except Exception as exc:  # noqa: BLE001 - the other mode still runs
            check(f"{mode}: engines ran", False, f"{exc!r}\n{traceback.format_exc()[-1500:]}")
            identical[mode] = False
            continue
        same = sum(a == b for a, b in zip(r.token_ids, base[mode].token_ids))
        identical[mode] = same == len(prompts)
        runs[f"dlite/{mode}"]["identical"] = f"{same}/{len(prompts)}"
        d = runs[f"dlite/{mode}"]
        check(f"{mode}: greedy identical to no speculation", identical[mode], f"{same}/{len(prompts)} identical")
        check(f"{mode}: DLite speculator in the runner", "DLite" in str(d["speculator"]),
              f"runner {d['version']}, speculator {d['speculator']}")
        check(f"{mode}: drafts made and accepted", d["drafts"] > 0 and d["accepted"] > 0,
              f"drafts {d['drafts']} accepted {d['accepted']} tau {d['tau']}")
        check(f"{mode}: no draft KV (pool == no speculation)", r.num_gpu_blocks == base[mode].num_gpu_blocks,
              f"{r.num_gpu_blocks} vs {base[mode].num_gpu_blocks} KV blocks")
    rec["model_runner"] = next((v["version"] for v in runs.values() if v.get("version")), None)
    rec["speculator"] = next((v["speculator"] for n, v in runs.items() if n.startswith("dlite") and v["speculator"]),
                             None)
    rec["lossless_greedy"] = bool(identical) and all(identical.values())
    rec["cuda_graphs"] = bool(identical.get("cuda_graphs"))
    mode, eager = modes[-1]
    name = "probabilistic drafts, mixed batch: greedy rows identical, sampled rows complete"
    if mode in base:
        mixed = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=max_tokens, ignore_eos=True,
                                seed=i) for i in range(len(prompts))]
        try:
            r = run(f"dlite-probabilistic/{mode}", {**spec, "draft_sample_method": "probabilistic"}, eager, mixed)
            greedy_same = all(r.token_ids[i] == base[mode].token_ids[i] for i in range(0, len(prompts), 2))
            complete = all(len(o) == max_tokens for o in r.token_ids)
            check(name, greedy_same and complete and runs[f"dlite-probabilistic/{mode}"]["drafts"] > 0,
                  f"tau {runs[f'dlite-probabilistic/{mode}']['tau']}")
        except Exception as exc:  # noqa: BLE001
            check(name, False, f"{exc!r}\n{traceback.format_exc()[-1500:]}")
    return rec


# ============================================================================ the GPU test
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if pytest is not None:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")]
    MODES = ("eager", "cuda_graphs")

    @pytest.fixture(scope="module")
    def record():
        """Every engine of :func:`lossless_record` once (Model Runner V2, in-process engines)."""
        pytest.importorskip("vllm")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        from vllm_dlite.vllm.plugin import register

        register()
        return lossless_record(on_gpu=True)

    def _passed(record: dict, name: str) -> None:
        found = [c for c in record["checks"] if c["name"] == name]
        assert found, (f"check {name!r} did not run", [c for c in record["checks"] if not c["ok"]])
        assert found[0]["ok"], found[0]["detail"]

    def test_model_runner_v2(record):
        assert record["model_runner"] == "v2", record["runs"]

    @pytest.mark.parametrize("mode", MODES)
    def test_greedy_identical_to_no_speculation(record, mode):
        _passed(record, f"{mode}: greedy identical to no speculation")

    @pytest.mark.parametrize("mode", MODES)
    def test_dlite_speculator_drafts_and_is_accepted(record, mode):
        _passed(record, f"{mode}: DLite speculator in the runner")
        _passed(record, f"{mode}: drafts made and accepted")

    @pytest.mark.parametrize("mode", MODES)
    def test_no_draft_kv(record, mode):
        _passed(record, f"{mode}: no draft KV (pool == no speculation)")

    def test_probabilistic_drafts_in_a_mixed_batch(record):
        _passed(record, "probabilistic drafts, mixed batch: greedy rows identical, sampled rows complete")
