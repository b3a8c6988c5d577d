#!/usr/bin/env python3
"""Every GPU check of the project in one bounded run (< 8 minutes on one H200), in stages.

    python3 benchmarks/gpu_check.py --out $OUT                  # on the GPU machine (vLLM 0.32 on PYTHONPATH:
                                                                # scripts/gpu/unpack.py ... --run -- this)
    python3 benchmarks/gpu_check.py --out /tmp/x                # on a machine without CUDA: DRY mode
    .venv/bin/python benchmarks/gpu_check.py --out /tmp/x --cpu-smoke --stages b,c   # stage code on CPU, tiny

Stages (each in its own process, with its own time limit, so that a crash or a hang in one still
leaves the earlier ones reported; ``results.json`` / ``results.md`` are rewritten after each):

a_smoke     vLLM smoke: a random tiny Qwen3 (bf16), ``enforce_eager``, token-id prompts; versions, the
            model runner (V1/V2) and the attention backend in use.
b_lossless  The shipped tiny target ``models/qwen3-tiny-stdlib`` + DLite ``models/dlite-qwen3-tiny-stdlib``
            on Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), fp32 (exact comparisons): greedy outputs
            with DLite == without speculation on 32 held-out agentic prompts (rendered by
            ``vllm_dlite.train.offline_eval.load_requests``) at max batch 16, eager AND with CUDA graphs; no
            draft KV (pool == no speculation); probabilistic drafts (``draft_sample_method=probabilistic``)
            in a mixed greedy/sampled batch (greedy rows identical, sampled rows complete); the
            speculator class printed ("CUDA graphs": full graphs of the uniform decode/verify steps,
            without torch.compile, unless ``--b-compile vllm``). If the shipped drafter cannot be
            loaded (e.g. it is being retrained in another format) the same checks run on random tiny
            models with a "copy" drafter (tests/helpers_vllm.py) and the reason is recorded.
c_speed     Speed on the GPU, bf16, K=7, CUDA graphs (as in b; ``--c-compile``), held-out agentic and
            code turns: none / ngram / EAGLE-3 / DFlash / DLite (the shipped tiny drafters) at batch
            1, 8, 32 (one engine per
            method, max_num_seqs 32, batch b = b requests submitted at once): output tok/s, mean ITL,
            tau, draft round ms (GPU time between CUDA events around the speculator's ``propose`` on
            V2; ``DraftTimer`` on V1), share of outputs identical to none.
d_shapes    Qwen3-8B shapes with random weights, plain torch (no vLLM), bf16, each step captured in a
            CUDA graph and replayed: target decode step (1 token) and verify step (K+1 = 8 tokens):
            36 Qwen3 decoder layers (RMSNorm, QKV, q/k norm, RoPE, KV-cache append, SDPA with GQA over the
            cache, O, SwiGLU MLP) + final norm + lm_head over every new row, at batch 1-64 and
            context 1k-32k; the KV caches of the 36 layers rotate over as many distinct buffers as fit
            in ``--d-kv-gib`` (never fewer than needed to stay out of L2). Against: the dlite_v1 draft
            round (``DLiteDrafter``: 5 layers, r 512, 14 features ``build_target_layer_ids(36, 14)``,
            K = 7, greedy; history-free, so one number per batch), and approximations of an EAGLE-3
            round (7 x [one decoder layer, 1 token over the context + lm_head over a 32k draft
            vocabulary]) and a DFlash round (5 decoder layers over K+1 = 8 tokens attending to the
            context + lm_head over K rows, 151,936 vocabulary). Ratios draft / verify.

The vLLM release is whichever the bundle carries (``scripts/gpu/build_bundle.py --vllm-version``);
stage a records it (``versions``).

What only a GPU can check of the V2 speculator's CUDA-graph path (the rest, capture sizes,
padding of a batch to the next captured size, the static input buffers and the replay of the
whole draft step over them, is tested on CPU in
``tests/test_vllm_integration.py::test_v2_graph_step_over_static_buffers``): the capture itself
into vLLM's global graph pool (``torch.cuda.graph``), replay on the device, vLLM's cudagraph memory
profiling discarding ``_DLiteGraphs``, and that graph replays stay lossless (stage b, graphs on).

``results.json``: ``device``, ``model_runner`` ("v2"/"v1"), ``lossless_greedy``, ``cuda_graphs`` (true when
the graph run was lossless), ``dlite_vs_none_batch1`` (tok/s ratio, agentic, batch 1), per-stage status,
and the tables. Without CUDA (and without ``--cpu-smoke``) the script only lists the stages (DRY mode:
``device`` = "no CUDA"), writes that and exits 0; vLLM is imported only inside the stages.
Exit status: 0 when every stage that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = REPO / "models" / "qwen3-tiny-stdlib"
DRAFTERS = {m: REPO / "models" / f"{m}-qwen3-tiny-stdlib" for m in ("dlite", "eagle3", "dflash")}
WORKLOADS = {k: REPO / "benchmarks" / "workloads" / f"heldout_{k}.jsonl" for k in ("agentic", "code")}
STAGES = {
    "a": ("a_smoke", "vLLM smoke: random tiny Qwen3, bf16, enforce_eager, token-id prompts"),
    "b": ("b_lossless", "shipped tiny target + DLite on Model Runner V2, fp32: greedy == no speculation on 32 "
                        "held-out agentic prompts at batch 16, eager and CUDA graphs; probabilistic drafts "
                        "in a mixed batch; speculator type"),
    "c": ("c_speed", "bf16, K=7, held-out agentic + code: none/ngram/eagle3/dflash/dlite at batch 1, 8, 32: "
                     "tok/s, ITL, tau, draft round ms"),
    "d": ("d_shapes", "Qwen3-8B shapes, random weights, plain torch: target decode/verify step vs dlite_v1 "
                      "draft round (and EAGLE-3 / DFlash approximations), batch 1-64, context 1k-32k"),
}
# seconds each stage may take at most (the whole run must stay under 8 minutes on the GPU)
STAGE_LIMIT_S = {"a": 75, "b": 150, "c": 170, "d": 75}


# ============================================================================ common helpers
def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def vllm_env(on_gpu: bool) -> None:
    """In-process engine (the timers and the runner checks read the model runner), Model Runner V2
    on the GPU; on CPU the small-machine settings of the tests."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if on_gpu:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    else:
        from vllm_dlite.vllm.engine import use_cpu_env

        use_cpu_env(2, threads=1)


def runner_info(llm) -> dict:
    """Model runner version and speculator / drafter class of the (in-process) engine."""
    def probe(worker):
        runner = worker.model_runner
        mod = type(runner).__module__
        spec = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
        backend = None
        try:  # V1 and V2 both keep attn_groups[kv group][i].backend (a class)
            be = runner.attn_groups[0][0].backend
            backend = be.get_name() if hasattr(be, "get_name") else getattr(be, "__name__", str(be))
        except Exception:  # noqa: BLE001 - best effort
            pass
        return dict(module=mod, runner=type(runner).__name__,
                    version="v2" if ".worker.gpu." in mod + "." else "v1",
                    speculator=type(spec).__name__ if spec is not None else None, attn_backend=backend)
    try:
        return llm.collective_rpc(probe)[0]
    except Exception as exc:  # noqa: BLE001
        return dict(error=repr(exc))


class EventDraftTimer:
    """Draft rounds on Model Runner V2: CUDA events around ``runner.speculator.propose`` (no host
    sync, so throughput is not disturbed). ``rounds()`` after the run: ``(ms, num_reqs, num_tokens)``."""

    def __init__(self, llm):
        self.llm, self._raw, self._spec = llm, [], None

    def __enter__(self) -> "EventDraftTimer":
        raw = self._raw

        def patch(worker):
            spec = getattr(worker.model_runner, "speculator", None)
            if spec is None or not hasattr(spec, "propose"):
                return None
            import torch

            original = spec.propose

            def timed(*a, **kw):
                batch = kw.get("input_batch", a[0] if a else None)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = original(*a, **kw)
                end.record()
                raw.append((start, end, int(getattr(batch, "num_reqs", 0)), int(getattr(batch, "num_tokens", 0))))
                return out

            spec.propose = timed
            return spec

        self._spec = self.llm.collective_rpc(patch)[0]
        return self

    def __exit__(self, *exc) -> None:
        if self._spec is not None and "propose" in vars(self._spec):
            del self._spec.propose

    def rounds(self) -> list[tuple[float, int, int]]:
        import torch

        torch.cuda.synchronize()
        out = [(s.elapsed_time(e), n, t) for s, e, n, t in self._raw]
        self._raw.clear()
        return out


# "vllm": vLLM's default (torch.compile + FULL_AND_PIECEWISE graphs); "none": no torch.compile, full
# CUDA graphs of uniform decode/verify steps only (starts in seconds instead of a compile per engine)
COMPILE_MODES = {"vllm": None, "none": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


def gpu_engine_kwargs(on_gpu: bool, enforce_eager: bool, compile_mode: str = "vllm") -> dict:
    if not on_gpu:
        return {}
    kw: dict = dict(gpu_memory_utilization=0.15)
    if not enforce_eager and COMPILE_MODES[compile_mode] is not None:
        kw["compilation_config"] = dict(COMPILE_MODES[compile_mode])
    return kw


def engine_run(target, prompts: list[list[int]], params, spec: Optional[dict], *, dtype: str,
               max_model_len: int, max_num_seqs: int, enforce_eager: bool, on_gpu: bool,
               compile_mode: str = "vllm") -> dict:
    """One fresh in-process engine, one generate over ``prompts``; outputs, counters, runner info."""
    from vllm_dlite.vllm.engine import build_llm, shutdown
    from lab.harness.replay import kv_pool_tokens, spec_decode_counters

    extra = dict(enforce_eager=enforce_eager, **gpu_engine_kwargs(on_gpu, enforce_eager, compile_mode))
    t0 = time.perf_counter()
    llm = build_llm(target, spec, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, **extra)
    startup = time.perf_counter() - t0
    try:
        info = runner_info(llm)
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t1
        c = spec_decode_counters(llm)
        return dict(outputs=[list(o.outputs[0].token_ids) for o in outs], drafts=int(c["drafts"]),
                    accepted=int(c["accepted"]), tau=(1 + c["accepted"] / c["drafts"]) if c["drafts"] else None,
                    kv_pool_tokens=kv_pool_tokens(llm), startup_s=round(startup, 1), wall_s=round(wall, 2), **info)
    finally:
        shutdown(llm)
        free_gpu()


def engine_run_child(target: str, prompts, params, spec, kw: dict) -> dict:
    """:func:`engine_run` in a spawned process (environment and plugin set up first)."""
    vllm_env(kw["on_gpu"])
    from vllm_dlite.vllm.plugin import register

    register()
    return engine_run(target, prompts, params, spec, **kw)


def free_gpu() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def shipped_requests(kind: str, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """``n`` held-out turns of ``kind`` (evenly spread over the file), rendered with the target's chat
    template (the project's replay helpers)."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.offline_eval import load_requests

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    reqs = load_requests(tok, [str(WORKLOADS[kind])], max_prompt_tokens=max_prompt_tokens, max_requests_per_kind=n)
    return [r.prompt_token_ids for r in reqs]


def drafter_problem(path: Path) -> Optional[str]:
    """Why a DLite checkpoint cannot be served (None: its config is a valid dlite_v1 config)."""
    from vllm_dlite.config import DLiteConfig

    try:
        cfg = json.loads((path / "config.json").read_text())
        DLiteConfig.from_checkpoint_config(cfg)
        if not (path / "model.safetensors").exists():
            return "no model.safetensors"
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:300]}"


# ============================================================================ stage a
def stage_a(args, rec: dict, save: Callable[[], None]) -> bool:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    on_gpu = torch.cuda.is_available()
    vllm_env(on_gpu)
    d = tempfile.mkdtemp(prefix="gpu-check-smoke-")
    cfg = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = "bfloat16" if on_gpu else "float32"
    Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(d, safe_serialization=True)
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    from vllm_dlite.vllm.engine import shutdown

    rec["versions"] = dict(vllm=vllm.__version__, torch=torch.__version__, python=sys.version.split()[0],
                           cuda=torch.version.cuda, vllm_file=vllm.__file__, import_s=round(time.perf_counter() - t0, 1))
    try:
        import triton

        rec["versions"]["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    save()
    extra = dict(gpu_memory_utilization=0.15) if on_gpu else {}
    t1 = time.perf_counter()
    llm = LLM(model=d, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=256,
              max_num_seqs=8, **extra)
    rec["startup_s"] = round(time.perf_counter() - t1, 1)
    rec.update(runner_info(llm))
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8, 9]}],
                        SamplingParams(max_tokens=8, temperature=0.0, detokenize=False), use_tqdm=False)
    rec["generated"] = [list(o.outputs[0].token_ids) for o in outs]
    rec["total_s"] = round(time.perf_counter() - t0, 1)
    shutdown(llm)
    ok = all(len(g) == 8 for g in rec["generated"])
    rec["checks"] = [dict(name="8 tokens generated for each prompt", ok=ok)]
    return ok


# ============================================================================ stage b
def stage_b(args, rec: dict, save: Callable[[], None]) -> bool:
    import torch

    on_gpu = torch.cuda.is_available()
    vllm_env(on_gpu)
    from vllm import SamplingParams

    from lab.harness.replay import in_fresh_process
    from vllm_dlite.vllm.plugin import register
    from vllm_dlite.vllm.engine import speculative_config

    register()
    n = args.num_prompts
    problem = drafter_problem(DRAFTERS["dlite"])
    if problem is None:
        target, drafter = TARGET, DRAFTERS["dlite"]
        prompts = shipped_requests("agentic", n, args.b_max_prompt_tokens)
        k = json.loads((drafter / "config.json").read_text())["block_size"] - 1
        rec["models"] = dict(target=str(target.relative_to(REPO)), drafter=str(drafter.relative_to(REPO)),
                             prompts="held-out agentic turns", k=k)
    else:
        sys.path.insert(0, str(REPO / "tests"))
        import helpers_vllm as H
        from transformers import AutoTokenizer

        models = H.tiny_models(Path(tempfile.mkdtemp(prefix="gpu-check-tiny-")))
        target, drafter, k = models.target, models.copy_drafter, H.BLOCK_K
        tok = AutoTokenizer.from_pretrained(str(target))
        prompts = [tok(p)["input_ids"] for p in H.make_prompts(n)]
        rec["models"] = dict(target="random tiny Qwen3 (tests/helpers_vllm.py)", drafter="random copy drafter",
                             prompts=f"{n} short prompts", k=k,
                             why=f"shipped drafter {DRAFTERS['dlite'].relative_to(REPO)} unusable: {problem}")
    rec["num_prompts"] = len(prompts)
    rec["graphs_compile"] = f"{args.b_compile}: {COMPILE_MODES[args.b_compile] or 'vLLM default'}"
    rec["prompt_tokens"] = dict(min=min(map(len, prompts)), max=max(map(len, prompts)))
    spec = speculative_config("dlite", k, drafter)
    max_len = max(map(len, prompts)) + args.b_max_tokens + 16
    greedy = SamplingParams(temperature=0.0, max_tokens=args.b_max_tokens, ignore_eos=True)
    dtype = args.b_dtype
    runs, checks = rec.setdefault("runs", {}), rec.setdefault("checks", [])

    def check(name, ok, detail=""):
        checks.append(dict(name=name, ok=bool(ok), detail=detail))
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
        save()

    def run(name, sp, eager, params=greedy):
        nonlocal dtype
        kw = dict(dtype=dtype, max_model_len=max_len, max_num_seqs=args.b_batch, enforce_eager=eager, on_gpu=on_gpu,
                  compile_mode=args.b_compile)
        note = None
        try:
            r = engine_run(target, prompts, params, sp, **kw)
        except Exception as exc:  # noqa: BLE001
            if dtype == "float32" and not runs:  # the first engine: fp32 may not be served here
                rec["dtype_fallback"] = f"float32 failed ({exc!r:.300}); bf16 instead (exact identity not guaranteed)"
                dtype = "bfloat16"
                r = engine_run(target, prompts, params, sp, **{**kw, "dtype": dtype})
            else:  # one retry in a fresh process (state left by earlier engines)
                note = f"in-process engine failed ({exc!r:.300}); ran in a fresh process"
                print(f"  {name}: {note}", flush=True)
                r = in_fresh_process(engine_run_child, str(target), prompts, params, sp, kw)
        runs[name] = {k_: v for k_, v in r.items() if k_ != "outputs"}
        runs[name]["dtype"] = dtype
        if note:
            runs[name]["note"] = note
        print(f"  {name}: {runs[name]}", flush=True)
        save()
        return r

    identical: dict[str, bool] = {}
    base: dict[str, dict] = {}
    modes = [("eager", True), ("cuda_graphs", False)] if on_gpu else [("eager", True)]
    for mode, eager in modes:
        try:
            base[mode] = run(f"none/{mode}", None, eager)
            r = run(f"dlite/{mode}", spec, eager)
        except Exception as exc:  # noqa: BLE001
            check(f"{mode}: engines ran", False, f"{exc!r}\n{traceback.format_exc()[-1500:]}")
            identical[mode] = False
            continue
        same = sum(a == b for a, b in zip(r["outputs"], base[mode]["outputs"]))
        identical[mode] = same == len(prompts)
        runs[f"dlite/{mode}"]["identical"] = f"{same}/{len(prompts)}"
        check(f"{mode}: greedy identical to no speculation", identical[mode], f"{same}/{len(prompts)} identical")
        check(f"{mode}: DLite speculator in the runner", "DLite" in str(r.get("speculator")),
              f"{r.get('runner')} ({r.get('version')}) speculator {r.get('speculator')}")
        check(f"{mode}: drafts made and accepted", r["drafts"] > 0 and r["accepted"] > 0,
              f"drafts {r['drafts']} accepted {r['accepted']} tau {r['tau']}")
        check(f"{mode}: no draft KV (pool == no speculation)", r["kv_pool_tokens"] == base[mode]["kv_pool_tokens"],
              f"{r['kv_pool_tokens']} vs {base[mode]['kv_pool_tokens']} tokens")
    rec["model_runner"] = next((v.get("version") for v in runs.values() if v.get("version")), None)
    rec["speculator"] = next((v.get("speculator") for k_, v in runs.items() if k_.startswith("dlite") and
                              v.get("speculator")), None)
    rec["lossless_greedy"] = bool(identical) and all(identical.values())
    rec["cuda_graphs"] = bool(identical.get("cuda_graphs"))
    mode = modes[-1][0]
    if mode in base:
        mixed = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=args.b_max_tokens,
                                ignore_eos=True, seed=i) for i in range(len(prompts))]
        try:
            r = run(f"dlite-probabilistic/{mode}", {**spec, "draft_sample_method": "probabilistic"},
                    modes[-1][1], params=mixed)
            greedy_same = all(r["outputs"][i] == base[mode]["outputs"][i] for i in range(0, len(prompts), 2))
            complete = all(len(o) == args.b_max_tokens for o in r["outputs"])
            check("probabilistic drafts, mixed batch: greedy rows identical, sampled rows complete",
                  greedy_same and complete and r["drafts"] > 0, f"tau {r['tau']}")
        except Exception as exc:  # noqa: BLE001
            check("probabilistic drafts, mixed batch", False, f"{exc!r}\n{traceback.format_exc()[-1500:]}")
    return all(c["ok"] for c in checks) and bool(checks)


# ============================================================================ stage c
def measure_method(method: str, prompts: dict, args, on_gpu: bool) -> dict:
    """One engine for ``method`` (max_num_seqs = the largest batch); every workload x batch size.
    Returns ``{info, startup_s, rows, outputs}`` (``outputs[(kind, b)]``: generated ids)."""
    vllm_env(on_gpu)
    from vllm_dlite.vllm.plugin import register
    from vllm_dlite.vllm.engine import MethodUnavailable, build_llm, shutdown, speculative_config
    from lab.harness.replay import DraftTimer, run_replay

    register()
    batches = [int(b) for b in args.c_batches.split(",")]
    spec = speculative_config(method, args.k, DRAFTERS.get(method))
    if method == "dlite":
        problem = drafter_problem(DRAFTERS["dlite"])
        if problem:
            raise MethodUnavailable(f"shipped DLite drafter unusable: {problem}")
    max_len = max(len(p) for v in prompts.values() for p in v) + args.c_max_tokens + 16
    t0 = time.perf_counter()
    llm = build_llm(TARGET, spec, dtype=args.c_dtype, max_model_len=max_len, max_num_seqs=max(batches),
                    enforce_eager=not on_gpu, **gpu_engine_kwargs(on_gpu, not on_gpu, args.c_compile))
    rows, outputs = [], {}
    try:
        info = runner_info(llm)
        startup = time.perf_counter() - t0
        run_replay(llm, "warm-up", prompts["agentic"][:1], max_tokens=8)
        v2 = info.get("version") == "v2" and on_gpu
        for kind, plist in prompts.items():
            for b in batches:
                chosen = plist[:max(b * args.c_waves, args.c_min_requests if b == 1 else 0)]
                timer = EventDraftTimer(llm) if v2 else DraftTimer()
                wall = toks = drafts = acc = 0
                itl, outs = [], []
                with timer:
                    for i in range(0, len(chosen), b):
                        r = run_replay(llm, method, chosen[i:i + b], max_tokens=args.c_max_tokens)
                        wall += r.wall_s
                        toks += r.output_tokens
                        drafts += r.num_drafts
                        acc += r.accepted_tokens
                        outs += r.outputs
                        if not math.isnan(r.mean_itl_ms):
                            itl.append((r.mean_itl_ms, len(r.outputs)))
                if v2:
                    rounds = [ms for ms, n, t in timer.rounds() if t <= n * (args.k + 1)]
                    how = "CUDA events around speculator.propose (steady rounds)"
                else:
                    rounds = [1000 * d.seconds for d in timer.records if d.verifying]
                    how = "DraftTimer (V1 runner, synchronised)"
                outputs[(kind, b)] = outs
                rows.append(dict(method=method, workload=kind, batch=b, requests=len(chosen), output_tokens=toks,
                                 tok_s=round(toks / wall, 1) if wall else None,
                                 itl_ms=round(sum(m * n for m, n in itl) / sum(n for _, n in itl), 3) if itl else None,
                                 tau=round(1 + acc / drafts, 3) if drafts else None,
                                 draft_round_ms=round(statistics.median(rounds), 3) if rounds and method != "none" else None,
                                 draft_rounds=len(rounds) if method != "none" else 0, draft_timing=how,
                                 runner=info.get("version"), speculator=info.get("speculator"),
                                 startup_s=round(startup, 1)))
                print(f"  {rows[-1]}", flush=True)
    finally:
        shutdown(llm)
        free_gpu()
    return dict(info=info, rows=rows, outputs=outputs)


def stage_c(args, rec: dict, save: Callable[[], None]) -> bool:
    import torch

    on_gpu = torch.cuda.is_available()
    vllm_env(on_gpu)
    from lab.harness.replay import in_fresh_process
    from vllm_dlite.vllm.engine import MethodUnavailable

    batches = [int(b) for b in args.c_batches.split(",")]
    methods = args.c_methods.split(",")
    need = {b: max(b * args.c_waves, args.c_min_requests if b == 1 else 0) for b in batches}
    prompts = {kind: shipped_requests(kind, max(need.values()), args.c_max_prompt_tokens) for kind in WORKLOADS}
    short = {k: len(v) for k, v in prompts.items() if len(v) < max(need.values())}
    if short:
        raise ValueError(f"too few held-out turns with prompts <= {args.c_max_prompt_tokens} tokens: {short} "
                         f"(need {max(need.values())}); raise --c-max-prompt-tokens")
    rec["settings"] = dict(k=args.k, dtype=args.c_dtype, max_tokens=args.c_max_tokens, batches=batches,
                           compile=f"{args.c_compile}: {COMPILE_MODES[args.c_compile] or 'vLLM default'}",
                           requests_per_batch=need, eager=not on_gpu, methods=methods,
                           prompts={k: len(v) for k, v in prompts.items()},
                           prompt_tokens={k: [min(map(len, v)), max(map(len, v))] for k, v in prompts.items()})
    rows, errors, notes = rec.setdefault("rows", []), rec.setdefault("errors", {}), rec.setdefault("notes", {})
    none_outputs: dict = {}
    deadline = time.time() + args.c_budget_s
    for method in methods:
        if time.time() > deadline:
            errors[method] = "skipped: out of time"
            save()
            continue
        try:
            try:
                if os.environ.get("GPU_CHECK_FORCE_FRESH_PROCESS") == "1":  # exercises the retry (tests)
                    raise RuntimeError("GPU_CHECK_FORCE_FRESH_PROCESS=1")
                res = measure_method(method, prompts, args, on_gpu)
            except MethodUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - one retry in a fresh process (engine state)
                if time.time() > deadline - 20:
                    raise
                notes[method] = f"in-process engine failed ({exc!r:.300}); measured in a fresh process"
                print(f"  {method}: {notes[method]}", flush=True)
                save()
                res = in_fresh_process(measure_method, method, prompts, args, on_gpu)
        except Exception as exc:  # noqa: BLE001
            errors[method] = f"{exc!r:.500}\n{traceback.format_exc()[-1200:]}"
            print(f"[FAIL] {method}: {exc!r}", flush=True)
            save()
            continue
        if method == "none":
            none_outputs = res["outputs"]
        for row in res["rows"]:
            ref, outs = none_outputs.get((row["workload"], row["batch"])), res["outputs"][(row["workload"], row["batch"])]
            row["identical_to_none"] = (f"{sum(a == c for a, c in zip(outs, ref))}/{len(outs)}"
                                        if ref is not None else None)
            rows.append(row)
        save()
    by = {(r["method"], r["workload"], r["batch"]): r for r in rows}
    n1, d1 = by.get(("none", "agentic", min(batches))), by.get(("dlite", "agentic", min(batches)))
    if n1 and d1 and n1["tok_s"] and d1["tok_s"]:
        rec["dlite_vs_none_batch1"] = round(d1["tok_s"] / n1["tok_s"], 3)
    return not errors and bool(rows)


# ============================================================================ stage d
class Qwen3Shapes:
    """Sizes of the target and drafters in stage d (Qwen3-8B by default; tiny ones for CPU tests)."""

    def __init__(self, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                 vocab=151936, draft_layers=5, rank=512, features=14, k=7, eagle_vocab=32000, dflash_layers=5):
        self.__dict__.update(locals())
        del self.__dict__["self"]


class TorchStack:
    """Qwen3 decoder layers in plain torch with KV caches (what stage d times for the target)."""

    def __init__(self, s: Qwen3Shapes, num_layers: int, vocab: int, device, dtype, seed: int = 0):
        import torch

        g = torch.Generator(device=device).manual_seed(seed)
        H, D, Hq, Hkv, I = s.hidden, s.head_dim, s.heads, s.kv_heads, s.intermediate

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02)

        self.s, self.device, self.dtype = s, device, dtype
        self.layers = [dict(qkv=w(H, (Hq + 2 * Hkv) * D), o=w(Hq * D, H), gu=w(H, 2 * I), down=w(I, H),
                            n1=torch.ones(H, device=device, dtype=dtype), n2=torch.ones(H, device=device, dtype=dtype),
                            qn=torch.ones(D, device=device, dtype=dtype), kn=torch.ones(D, device=device, dtype=dtype))
                       for _ in range(num_layers)]
        self.norm = torch.ones(H, device=device, dtype=dtype)
        self.lm_head = w(H, vocab)

    @staticmethod
    def rms(x, weight, eps=1e-6):
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

    def rope_tables(self, positions):
        import torch

        D = self.s.head_dim
        inv = 1.0 / (1_000_000.0 ** (torch.arange(0, D, 2, device=self.device, dtype=torch.float32) / D))
        ang = positions.float()[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def step(self, x, caches, pos: int, cos, sin, num_layers: Optional[int] = None, logits_rows: Optional[int] = None):
        """x ``[b, q, H]`` new tokens at positions pos..pos+q-1; caches: list of (k, v) ``[b, Hkv, T, D]``
        used round-robin; returns logits of the last ``logits_rows`` rows (all by default)."""
        import torch
        import torch.nn.functional as F

        s = self.s
        b, q, H = x.shape
        Hq, Hkv, D, I = s.heads, s.kv_heads, s.head_dim, s.intermediate

        c_, s_ = cos[:, None], sin[:, None]  # [q, 1, D] against [b, q, heads, D]

        def rot(t):
            t1, t2 = t[..., : D // 2], t[..., D // 2:]
            return t * c_ + torch.cat([-t2, t1], -1) * s_

        for i, L in enumerate(self.layers[:num_layers]):
            kc, vc = caches[i % len(caches)]
            h = self.rms(x, L["n1"])
            qkv = h @ L["qkv"]
            qh, kh, vh = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
            qh = rot(self.rms(qh.view(b, q, Hq, D), L["qn"])).transpose(1, 2)
            kh = rot(self.rms(kh.view(b, q, Hkv, D), L["kn"])).transpose(1, 2)
            kc[:, :, pos:pos + q] = kh
            vc[:, :, pos:pos + q] = vh.view(b, q, Hkv, D).transpose(1, 2)
            # the q new rows see the whole cache (no mask among them: same cost as the causal one)
            a = F.scaled_dot_product_attention(qh, kc[:, :, :pos + q], vc[:, :, :pos + q], enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, q, Hq * D) @ L["o"]
            gu = self.rms(x, L["n2"]) @ L["gu"]
            x = x + (F.silu(gu[..., :I]) * gu[..., I:]) @ L["down"]
        rows = x if logits_rows is None else x[:, -logits_rows:]
        return self.rms(rows, self.norm) @ self.lm_head


def time_fn(fn: Callable[[], Any], device, iters: int, graph: bool) -> tuple[float, str]:
    """Median ms of ``fn``: replays of a CUDA graph of it (falls back to eager launches when the
    capture fails), or wall time on CPU."""
    import torch

    if device.type != "cuda":
        fn()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append(1000 * (time.perf_counter() - t))
        return statistics.median(ts), "cpu wall"
    how = "eager"
    run = fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, how = g.replay, "cuda graph"
        except Exception as exc:  # noqa: BLE001
            how = f"eager (graph capture failed: {exc!r:.120})"
            torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), how


def build_dlite(s: Qwen3Shapes, target: TorchStack, device, dtype):
    """The paper-size dlite_v1 drafter (random weights) bound to the target's embedding and norm."""
    import torch

    from vllm_dlite.config import DLiteConfig, build_target_layer_ids
    from vllm_dlite.model import DLiteDrafter

    cfg = DLiteConfig(hidden_size=s.hidden, num_hidden_layers=s.draft_layers, num_attention_heads=s.heads,
                      num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                      vocab_size=s.vocab, num_target_layers=s.layers,
                      target_layer_ids=build_target_layer_ids(s.layers, s.features), block_size=s.k + 1,
                      anchor_group_size=1, mask_token_id=s.vocab - 1, sequential_rank=s.rank)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device (1.3 B parameters at Qwen3-8B size)
        drafter = DLiteDrafter(cfg)
    drafter = drafter.to(dtype=dtype).eval()
    embed = target.lm_head.t().contiguous()  # [V, H]: a random embedding of the right shape
    drafter.bind_target(embed, torch.ones(s.hidden, device=device, dtype=dtype), 1e-6)
    return drafter


def stage_d(args, rec: dict, save: Callable[[], None], shapes: Optional[Qwen3Shapes] = None) -> bool:
    import torch

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    s = shapes or (Qwen3Shapes() if on_gpu else Qwen3Shapes(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
                                                               intermediate=128, vocab=512, draft_layers=1, rank=64,
                                                               features=3, eagle_vocab=128, dflash_layers=1))
    batches = [int(b) for b in args.d_batches.split(",")]
    contexts = [int(c) for c in args.d_contexts.split(",")]
    if not on_gpu:
        contexts = sorted({min(c, 64) for c in contexts})
    K = s.k
    rec["what"] = ("target step = %d Qwen3 layers (H %d, %d/%d heads x %d, MLP %d) with KV cache + SDPA, final "
                   "norm, lm_head %d over the new rows; decode = 1 new token, verify = K+1 = %d; dlite = "
                   "DLiteDrafter.draft (%d layers, r %d, %d features, K %d, greedy); eagle3 ~ %d x (1 layer, 1 "
                   "token over the context, lm_head %d); dflash ~ %d layers over K+1 tokens + lm_head %d over K "
                   "rows; %s; %s" % (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab,
                                     K + 1, s.draft_layers, s.rank, s.features, K, K, s.eagle_vocab,
                                     s.dflash_layers, s.vocab, str(dtype).replace("torch.", ""),
                                     "CUDA-graph replays, median" if on_gpu else "CPU wall, median"))
    deadline = time.time() + args.d_budget_s
    t0 = time.perf_counter()
    target = TorchStack(s, s.layers, s.vocab, device, dtype, seed=0)
    eagle = TorchStack(s, 1, s.eagle_vocab, device, dtype, seed=1)
    dflash = TorchStack(s, s.dflash_layers, s.vocab, device, dtype, seed=2)
    drafter = build_dlite(s, target, device, dtype)
    from vllm_dlite.ops import dispatch

    rec["setup_s"] = round(time.perf_counter() - t0, 1)
    rows, dlite_ms = rec.setdefault("rows", []), rec.setdefault("dlite_round_ms", {})
    g = torch.Generator(device=device).manual_seed(0)
    for b in batches:
        if time.time() > deadline:
            rec.setdefault("skipped", []).append(f"batch {b}: out of time")
            continue
        feats = torch.randn(b, s.features, s.hidden, generator=g, device=device, dtype=dtype)
        ids = torch.randint(0, s.vocab - 1, (b, 1), generator=g, device=device)
        ms, how = time_fn(lambda: drafter.draft(feats, ids, temperature=0.0, k=K), device, args.d_iters, True)
        dlite_ms[b] = dict(ms=round(ms, 3), how=how)
        rec["dlite_backend"] = dispatch.backend_report()
        for ctx in contexts:
            if time.time() > deadline:
                rec.setdefault("skipped", []).append(f"batch {b} context {ctx}: out of time")
                continue
            T = ctx + K + 1
            per_layer = 2 * b * s.kv_heads * T * s.head_dim * (2 if on_gpu else 4)
            m = int(min(s.layers, max(1, args.d_kv_gib * 2 ** 30 // per_layer)))
            row = dict(batch=b, context=ctx, kv_buffers=m, kv_gib_per_layer=round(per_layer / 2 ** 30, 3))
            try:
                caches = [(torch.zeros(b, s.kv_heads, T, s.head_dim, device=device, dtype=dtype),
                           torch.zeros(b, s.kv_heads, T, s.head_dim, device=device, dtype=dtype)) for _ in range(m)]
                for name, stack, q, reps, layers, logits_rows in (
                        ("decode", target, 1, 1, None, None), ("verify", target, K + 1, 1, None, None),
                        ("eagle3", eagle, 1, K, None, None), ("dflash", dflash, K + 1, 1, None, K)):
                    x = torch.randn(b, q, s.hidden, generator=g, device=device, dtype=dtype)
                    cos, sin = stack.rope_tables(torch.arange(ctx, ctx + q, device=device))

                    def fn(stack=stack, x=x, q=q, reps=reps, cos=cos, sin=sin, layers=layers, lr=logits_rows):
                        for _ in range(reps):
                            stack.step(x, caches, ctx, cos, sin, layers, lr)

                    ms, how = time_fn(fn, device, args.d_iters, True)
                    row[f"{name}_ms"] = round(ms, 3)
                    row["how"] = how
                row["dlite_ms"] = dlite_ms[b]["ms"]
                for name in ("dlite", "eagle3", "dflash"):
                    row[f"{name}_over_verify"] = round(row[f"{name}_ms"] / row["verify_ms"], 4)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{exc!r:.300}"
            finally:
                caches = None
                free_gpu()
            rows.append(row)
            print(f"  {row}", flush=True)
            save()
    return bool(rows) and not any("error" in r for r in rows)


STAGE_FUNCS = {"a": stage_a, "b": stage_b, "c": stage_c, "d": stage_d}


# ============================================================================ orchestration
def device_name() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"


def run_stage_inprocess(args) -> int:
    """``--stage X``: run one stage here, writing ``stage_X.json`` as it goes."""
    key = args.stage
    path = args.out / f"stage_{key}.json"
    rec: dict = dict(name=STAGES[key][0], status="running", started=time.time())

    def save():
        write_json(path, rec)

    save()
    try:
        ok = STAGE_FUNCS[key](args, rec, save)
        rec["status"] = "ok" if ok else "failed"
    except Exception as exc:  # noqa: BLE001
        rec["status"] = "error"
        rec["error"] = f"{exc!r}\n{traceback.format_exc()[-3000:]}"
        print(rec["error"], flush=True)
    rec["wall_s"] = round(time.time() - rec["started"], 1)
    save()
    return 0 if rec["status"] == "ok" else 1


def summarize(out: Path, base: dict, stage_keys: list[str]) -> dict:
    """results.json from the stage files present; also writes results.md."""
    res = dict(base)
    res["stages"] = []
    stage_recs = {}
    for key in stage_keys:
        p = out / f"stage_{key}.json"
        rec = json.loads(p.read_text()) if p.exists() else dict(name=STAGES[key][0], status="not started")
        stage_recs[key] = rec
        res["stages"].append(dict(name=STAGES[key][0], status=rec.get("status"), wall_s=rec.get("wall_s")))
    a, b, c, d = (stage_recs.get(k, {}) for k in "abcd")
    res["model_runner"] = b.get("model_runner") or a.get("version")
    res["lossless_greedy"] = b.get("lossless_greedy")
    res["cuda_graphs"] = b.get("cuda_graphs")
    res["speculator"] = b.get("speculator")
    res["dlite_vs_none_batch1"] = c.get("dlite_vs_none_batch1")
    res["smoke"] = a
    res["lossless"] = b
    res["speed"] = c
    res["shapes"] = d
    write_json(out / "results.json", res)
    (out / "results.md").write_text(markdown(res))
    return res


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown(res: dict) -> str:
    L = [f"# GPU check: {res.get('device')}", ""]
    L.append(f"model runner {_cell(res.get('model_runner'))}, lossless greedy {_cell(res.get('lossless_greedy'))}, "
             f"CUDA graphs lossless {_cell(res.get('cuda_graphs'))}, speculator {_cell(res.get('speculator'))}, "
             f"DLite / none tok/s at batch 1 (agentic) {_cell(res.get('dlite_vs_none_batch1'))}")
    L += ["", "| stage | status | s |", "| --- | --- | --- |"]
    L += [f"| {s['name']} | {s['status']} | {_cell(s.get('wall_s'))} |" for s in res["stages"]]
    if res.get("dry_run"):
        L += ["", "DRY mode (no CUDA): the stages above would run:", ""]
        L += [f"- {s['name']}: {s['would_run']}" for s in res["stages"]]
        return "\n".join(L) + "\n"
    a = res.get("smoke") or {}
    if a:
        L += ["", "## a. smoke", "", f"versions {a.get('versions')}; runner {a.get('runner')} ({a.get('version')}), "
              f"attention {a.get('attn_backend')}; generated {a.get('generated')}; startup {a.get('startup_s')} s"]
        if a.get("error"):
            L += ["", "```", a["error"][-1500:], "```"]
    b = res.get("lossless") or {}
    if b:
        L += ["", "## b. lossless on the model runner", "", f"models: {b.get('models')}", "",
              "| check | ok | detail |", "| --- | --- | --- |"]
        L += [f"| {c['name']} | {'yes' if c['ok'] else 'NO'} | {str(c['detail'])[:200].replace('|', '/')} |"
              for c in b.get("checks", [])]
        L += ["", "| run | runner | speculator | dtype | drafts | accepted | tau | KV pool | identical | startup s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        L += [f"| {k} | {_cell(v.get('version'))} | {_cell(v.get('speculator'))} | {v.get('dtype')} | {v.get('drafts')} | "
              f"{v.get('accepted')} | {_cell(v.get('tau'))} | {v.get('kv_pool_tokens')} | {_cell(v.get('identical'))} | "
              f"{_cell(v.get('startup_s'))} |" for k, v in (b.get("runs") or {}).items()]
        if b.get("error"):
            L += ["", "```", b["error"][-1500:], "```"]
    c = res.get("speed") or {}
    if c:
        L += ["", "## c. speed", "", f"settings {c.get('settings')}", "",
              "| method | workload | batch | tok/s | ITL ms | tau | draft round ms | identical to none |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        L += [f"| {r['method']} | {r['workload']} | {r['batch']} | {_cell(r['tok_s'])} | {_cell(r['itl_ms'])} | "
              f"{_cell(r['tau'])} | {_cell(r['draft_round_ms'])} | {_cell(r['identical_to_none'])} |"
              for r in c.get("rows", [])]
        for m, e in (c.get("errors") or {}).items():
            L.append(f"\n{m}: {e.splitlines()[0][:300]}")
    d = res.get("shapes") or {}
    if d:
        L += ["", "## d. Qwen3-8B shapes (random weights)", "", d.get("what", ""), "",
              f"DLite backend: {str(d.get('dlite_backend', '')).splitlines()[:1]}", "",
              "| batch | context | decode ms | verify ms | dlite ms | eagle3 ms | dflash ms | dlite/verify | "
              "eagle3/verify | dflash/verify |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        L += [f"| {r['batch']} | {r['context']} | {_cell(r.get('decode_ms'))} | {_cell(r.get('verify_ms'))} | "
              f"{_cell(r.get('dlite_ms'))} | {_cell(r.get('eagle3_ms'))} | {_cell(r.get('dflash_ms'))} | "
              f"{_cell(r.get('dlite_over_verify'))} | {_cell(r.get('eagle3_over_verify'))} | "
              f"{_cell(r.get('dflash_over_verify'))} |" + (f" {r['error'][:100]}" if r.get("error") else "")
              for r in d.get("rows", [])]
        if d.get("error"):
            L += ["", "```", d["error"][-1500:], "```"]
    return "\n".join(L) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="a,b,c,d", help="which of a,b,c,d to run (in that order)")
    ap.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)  # internal: one stage here
    ap.add_argument("--dry-run", action="store_true", help="only list the stages (the default without CUDA)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the stages on CPU anyway (V1 runner, fp32, tiny shapes; for developing this script)")
    ap.add_argument("--deadline-s", type=float, default=460, help="the whole run stops starting stages after this")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round (default: the dlite drafter's K)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--b-batch", type=int, default=16)
    ap.add_argument("--b-max-tokens", type=int, default=48)
    ap.add_argument("--b-max-prompt-tokens", type=int, default=6144)
    ap.add_argument("--b-dtype", default="float32")
    ap.add_argument("--b-compile", choices=sorted(COMPILE_MODES), default="none",
                    help="CUDA-graph runs of stage b: 'none' = full graphs of decode/verify steps without "
                         "torch.compile (fits the time), 'vllm' = vLLM's default torch.compile + graphs")
    ap.add_argument("--c-compile", choices=sorted(COMPILE_MODES), default="none",
                    help="stage c engines: 'none' = full CUDA graphs of decode/verify steps without torch.compile "
                         "(seconds to start; 5 engines fit the time), 'vllm' = vLLM's default")
    ap.add_argument("--c-methods", default="none,dlite,ngram,eagle3,dflash",
                    help="in this order (DLite right after none: the most wanted if time runs out)")
    ap.add_argument("--c-batches", default="1,8,32")
    ap.add_argument("--c-waves", type=int, default=1, help="requests per batch size = batch x waves")
    ap.add_argument("--c-min-requests", type=int, default=4, help="requests at batch 1")
    ap.add_argument("--c-max-tokens", type=int, default=128)
    ap.add_argument("--c-max-prompt-tokens", type=int, default=6144)
    ap.add_argument("--c-dtype", default="bfloat16")
    ap.add_argument("--c-budget-s", type=float, default=150)
    ap.add_argument("--d-batches", default="1,8,32,64")
    ap.add_argument("--d-contexts", default="1024,4096,16384,32768")
    ap.add_argument("--d-iters", type=int, default=10)
    ap.add_argument("--d-kv-gib", type=float, default=40.0)
    ap.add_argument("--d-budget-s", type=float, default=60)
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, REPO / "models" / "dlite-qwen3-tiny-stdlib")  # default: the drafter's own K
    if args.cpu_smoke and args.b_dtype == "bfloat16":
        args.b_dtype = "float32"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage_inprocess(args)
    t0 = time.time()
    keys = [k.strip() for k in args.stages.split(",") if k.strip()]
    dev = device_name()
    base = dict(device=dev or "no CUDA", model_runner=None, lossless_greedy=None, cuda_graphs=None,
                dlite_vs_none_batch1=None, dry_run=False, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    if (dev is None and not args.cpu_smoke) or args.dry_run:
        base.update(dry_run=True, vllm_imported="vllm" in sys.modules,
                    stages=[dict(name=STAGES[k][0], status="not run (no CUDA)" if dev is None else "not run (dry run)",
                                 would_run=STAGES[k][1], limit_s=STAGE_LIMIT_S[k]) for k in keys])
        write_json(args.out / "results.json", base)
        (args.out / "results.md").write_text(markdown(base))
        print(("no CUDA: " if dev is None else "") + "DRY mode; the stages that would run:")
        for s in base["stages"]:
            print(f"  {s['name']} (<= {s['limit_s']} s): {s['would_run']}")
        return 0
    for k in keys:
        (args.out / f"stage_{k}.json").unlink(missing_ok=True)
    if args.cpu_smoke:
        base["cpu_smoke"] = True
    ok = True
    for k in keys:
        left = args.deadline_s - (time.time() - t0)
        if left < 20:
            write_json(args.out / f"stage_{k}.json", dict(name=STAGES[k][0], status="skipped (out of time)"))
            ok = False
            continue
        limit = min(STAGE_LIMIT_S[k] if not args.cpu_smoke else 1800, left)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", k] + [a for a in (argv or sys.argv[1:])]
        print(f"== stage {STAGES[k][0]} (limit {limit:.0f} s)", flush=True)
        t = time.time()
        with open(args.out / f"stage_{k}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        p = args.out / f"stage_{k}.json"
        rec = json.loads(p.read_text()) if p.exists() else dict(name=STAGES[k][0])
        if rc == "timeout":
            rec["status"] = f"timeout after {limit:.0f} s (partial results kept)"
        elif rec.get("status") in (None, "running"):
            rec["status"] = f"crashed (exit {rc})"
        rec.setdefault("wall_s", round(time.time() - t, 1))
        rec["log_tail"] = (args.out / f"stage_{k}.log").read_text()[-2500:]
        write_json(p, rec)
        ok &= rec["status"] == "ok"
        print(f"   {rec['status']} in {time.time() - t:.0f} s", flush=True)
        summarize(args.out, base, keys)
    res = summarize(args.out, {**base, "wall_s": round(time.time() - t0, 1)}, keys)
    print((args.out / "results.md").read_text())
    return 0 if ok and all(s["status"] == "ok" for s in res["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
