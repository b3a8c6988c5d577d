#!/usr/bin/env python3
"""Every GPU check of the project in one bounded run (< 8 minutes on one H200), in stages.

    python3 benchmarks/gpu_check.py --out $OUT                  # on the GPU machine (vLLM on PYTHONPATH:
                                                                # scripts/gpu/unpack.py ... --run -- this)
    python3 benchmarks/gpu_check.py --out /tmp/x                # on a machine without CUDA: DRY mode
    .venv/bin/python benchmarks/gpu_check.py --out /tmp/x --cpu-smoke --stages b,c   # stage code on CPU, tiny

This script only orchestrates: each stage runs in its own process, with its own time limit, so that a
crash or a hang in one still leaves the earlier ones reported; ``results.json`` / ``results.md`` are
rewritten after each. The stages call the project's pieces:

a_smoke     vLLM smoke (here): a random tiny Qwen3 (bf16), ``enforce_eager``, token-id prompts; versions,
            the model runner (V1/V2) and the attention backend in use.
b_lossless  ``tests/test_gpu.py`` (the ``gpu``-marked test; :func:`lossless_record` without pytest):
            shipped tiny target + DLite on Model Runner V2, fp32, 32 held-out agentic prompts at batch
            16: greedy == no speculation eager AND with CUDA graphs (``--b-compile``), no draft KV,
            probabilistic drafts in a mixed batch, the speculator class.
c_speed     ``benchmarks/ab.py`` (``run_levels``: one engine per method, batch b = b requests submitted
            at once): bf16, K=7, CUDA graphs (``--c-compile``), held-out agentic and code turns: none /
            DLite / ngram / EAGLE-3 / DFlash at batch 1, 8, 32: output tok/s, mean ITL, tau, draft round
            ms (CUDA events around the V2 speculator's ``propose``; ``DraftTimer`` on V1), share of
            outputs identical to none.
d_shapes    ``benchmarks/gpu_shapes.py`` (timed with ``gpu_kernels.time_ms``): Qwen3-8B shapes, random
            weights, plain torch + CUDA graphs: target decode / verify step vs the dlite_v1 draft round
            and EAGLE-3 / DFlash round approximations, batch 1-64, context 1k-32k.

The vLLM release is whichever the bundle carries (``scripts/gpu/build_bundle.py --vllm-version``);
stage a records it (``versions``).

``results.json``: ``device``, ``model_runner`` ("v2"/"v1"), ``lossless_greedy``, ``cuda_graphs`` (true when
the graph run was lossless), ``speculator``, ``dlite_vs_none_batch1`` (tok/s ratio, agentic, batch 1),
per-stage status, and the stage records (``smoke``, ``lossless``, ``speed``, ``shapes``). Without CUDA (and
without ``--cpu-smoke``) the script only lists the stages (DRY mode: ``device`` = "no CUDA"), writes that
and exits 0; vLLM is imported only inside the stages. Exit status: 0 when every stage that ran passed,
1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TESTS = REPO / "tests"  # test_gpu.py (stage b) and its helpers

TARGET = REPO / "models" / "qwen3-tiny-stdlib"
DLITE = REPO / "models" / "dlite-qwen3-tiny-stdlib"  # its K is the default --k
KINDS = ("agentic", "code")  # benchmarks/workloads/heldout_<kind>.jsonl
COMPILE_CHOICES = ("none", "vllm")  # benchmarks/ab.py COMPILE_MODES (not imported here: DRY mode stays light)
STAGES = {
    "a": ("a_smoke", "vLLM smoke: random tiny Qwen3, bf16, enforce_eager, token-id prompts"),
    "b": ("b_lossless", "tests/test_gpu.py: shipped tiny target + DLite on Model Runner V2, fp32: greedy == no "
                        "speculation on 32 held-out agentic prompts at batch 16, eager and CUDA graphs; "
                        "probabilistic drafts in a mixed batch; speculator type"),
    "c": ("c_speed", "benchmarks/ab.py run_levels: bf16, K=7, held-out agentic + code: "
                     "none/dlite/ngram/eagle3/dflash at batch 1, 8, 32: tok/s, ITL, tau, draft round ms"),
    "d": ("d_shapes", "benchmarks/gpu_shapes.py: Qwen3-8B shapes, random weights, plain torch: target "
                      "decode/verify step vs dlite_v1 draft round (and EAGLE-3 / DFlash approximations), "
                      "batch 1-64, context 1k-32k"),
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
        # the bundle carries no FlashInfer; V2's sampler imports its backend unless this is 0
        # (first GPU run, 2026-12-04: "No module named 'flashinfer'" in Sampler.__init__)
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
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


def free_gpu() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


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
    """tests/test_gpu.py's engines and checks (:func:`test_gpu.lossless_record`)."""
    import torch

    on_gpu = torch.cuda.is_available()
    vllm_env(on_gpu)
    sys.path.insert(0, str(TESTS))
    from test_gpu import lossless_record
    from vllm_dlite.vllm.plugin import register

    register()
    lossless_record(on_gpu, num_prompts=args.num_prompts, batch=args.b_batch, max_tokens=args.b_max_tokens,
                    max_prompt_tokens=args.b_max_prompt_tokens, dtype=args.b_dtype, compile_mode=args.b_compile,
                    save=save, rec=rec)
    return bool(rec["checks"]) and all(c["ok"] for c in rec["checks"])


# ============================================================================ stage c
def stage_c(args, rec: dict, save: Callable[[], None]) -> bool:
    """Every method through ``ab.run_levels`` (one engine per method: in this process, else once in a
    fresh one), one row per method x workload x batch."""
    import torch

    on_gpu = torch.cuda.is_available()
    vllm_env(on_gpu)
    sys.path.insert(0, str(TESTS))
    import ab  # beside this script
    from lab.harness.runners import current_runner
    from test_gpu import drafter_problem, held_out_prompts

    batches = [int(b) for b in args.c_batches.split(",")]
    methods = args.c_methods.split(",")
    need = {b: max(b * args.c_waves, args.c_min_requests if b == 1 else 0) for b in batches}
    by_kind = {kind: held_out_prompts(kind, max(need.values()), args.c_max_prompt_tokens) for kind in KINDS}
    short = {k: len(v) for k, v in by_kind.items() if len(v) < max(need.values())}
    if short:
        raise ValueError(f"too few held-out turns with prompts <= {args.c_max_prompt_tokens} tokens: {short} "
                         f"(need {max(need.values())}); raise --c-max-prompt-tokens")
    prompts, levels = [], []
    for kind in KINDS:
        levels += [(f"{kind}/{b}", b, range(len(prompts), len(prompts) + need[b])) for b in batches]
        prompts += by_kind[kind]
    runner = current_runner()
    opts = dict(dtype=args.c_dtype, max_model_len=max(map(len, prompts)) + args.c_max_tokens + 16, seed=0,
                temperature=0.0, max_tokens=args.c_max_tokens, runner=runner, k=args.k,
                engine=dict(enforce_eager=not on_gpu, **ab.engine_kwargs(args.c_compile, 0.15)))
    rec["settings"] = dict(k=args.k, dtype=args.c_dtype, max_tokens=args.c_max_tokens, batches=batches,
                           compile=f"{args.c_compile}: {ab.COMPILE_MODES[args.c_compile] or 'vLLM default'}",
                           requests_per_batch=need, eager=not on_gpu, methods=methods, runner=runner,
                           prompts={k: len(v) for k, v in by_kind.items()},
                           prompt_tokens={k: [min(map(len, v)), max(map(len, v))] for k, v in by_kind.items()})
    rows, errors, notes = rec.setdefault("rows", []), rec.setdefault("errors", {}), rec.setdefault("notes", {})
    none_outputs: dict = {}
    deadline = time.time() + args.c_budget_s
    for method in methods:
        if time.time() > deadline:
            errors[method] = "skipped: out of time"
            save()
            continue
        family = ab.drafter_family(method)
        drafter = str(ab.default_drafter(family)) if family in ("dlite", "eagle3", "dflash") else None
        try:
            problem = drafter_problem() if family == "dlite" else None
            if problem:
                raise RuntimeError(f"unavailable: shipped DLite drafter unusable: {problem}")
            try:
                if os.environ.get("GPU_CHECK_FORCE_FRESH_PROCESS") == "1":  # exercises the retry
                    raise RuntimeError("GPU_CHECK_FORCE_FRESH_PROCESS=1")
                res = ab.run_levels(str(TARGET), method, prompts, levels, opts, drafter=drafter, fresh=False)
            except Exception as exc:  # noqa: BLE001 - one retry in a fresh process (engine state)
                if time.time() > deadline - 20:
                    raise
                notes[method] = f"in-process engine failed ({exc!r:.300}); measured in a fresh process"
                print(f"  {method}: {notes[method]}", flush=True)
                save()
                res = ab.run_levels(str(TARGET), method, prompts, levels, opts, drafter=drafter, fresh=True)
            if res["status"] != "ok":
                raise RuntimeError(f"{res['status']}: {res['reason']}")
        except Exception as exc:  # noqa: BLE001
            errors[method] = f"{exc!r:.500}\n{traceback.format_exc()[-1200:]}"
            print(f"[FAIL] {method}: {exc!r}", flush=True)
            save()
            continue
        finally:
            free_gpu()
        for label, lv in res["levels"].items():
            kind, b = label.split("/")
            if method == "none":
                none_outputs[label] = lv["outputs"]
            ref = none_outputs.get(label)
            rows.append(dict(method=method, workload=kind, batch=int(b), requests=len(lv["outputs"]),
                             output_tokens=lv["output_tokens"], tok_s=round(lv["output_tokens_per_s"], 1),
                             itl_ms=None if lv["mean_itl_ms"] != lv["mean_itl_ms"] else round(lv["mean_itl_ms"], 3),
                             tau=None if lv["tau"] is None else round(lv["tau"], 3),
                             draft_round_ms=None if lv["draft_round_ms"] is None else round(lv["draft_round_ms"], 3),
                             draft_rounds=lv["draft_rounds"], runner=res["runner"],
                             draft_timing="CUDA events around speculator.propose (steady rounds)"
                             if res["runner"] == "v2" and on_gpu else "DraftTimer: the drafter's propose (V1)",
                             identical_to_none=f"{sum(a == c for a, c in zip(lv['outputs'], ref))}/{len(ref)}"
                             if ref is not None else None))
            print(f"  {rows[-1]}", flush=True)
        save()
    by = {(r["method"], r["workload"], r["batch"]): r for r in rows}
    n1, d1 = by.get(("none", "agentic", min(batches))), by.get(("dlite", "agentic", min(batches)))
    if n1 and d1 and n1["tok_s"] and d1["tok_s"]:
        rec["dlite_vs_none_batch1"] = round(d1["tok_s"] / n1["tok_s"], 3)
    return not errors and bool(rows)


# ============================================================================ stage d
def stage_d(args, rec: dict, save: Callable[[], None]) -> bool:
    """benchmarks/gpu_shapes.py's measurement (tiny shapes on CPU)."""
    import gpu_shapes  # beside this script

    return gpu_shapes.measure(rec, save, **gpu_shapes.measure_options(
        args.d_batches, args.d_contexts, args.d_iters, args.d_kv_gib, args.d_budget_s))


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
        L += ["", "| run | runner | speculator | dtype | drafts | accepted | tau | KV blocks | identical | wall s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        L += [f"| {k} | {_cell(v.get('version'))} | {_cell(v.get('speculator'))} | {v.get('dtype')} | {v.get('drafts')} | "
              f"{v.get('accepted')} | {_cell(v.get('tau'))} | {v.get('kv_blocks')} | {_cell(v.get('identical'))} | "
              f"{_cell(v.get('wall_s'))} |" for k, v in (b.get("runs") or {}).items()]
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
    ap.add_argument("--b-compile", choices=sorted(COMPILE_CHOICES), default="none",
                    help="CUDA-graph runs of stage b: 'none' = full graphs of decode/verify steps without "
                         "torch.compile (fits the time), 'vllm' = vLLM's default torch.compile + graphs")
    ap.add_argument("--c-compile", choices=sorted(COMPILE_CHOICES), default="none",
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
    # stage d: left out = benchmarks/gpu_shapes.py measure()'s defaults (batches 1,8,32,64, contexts 1k-32k)
    ap.add_argument("--d-batches")
    ap.add_argument("--d-contexts")
    ap.add_argument("--d-iters", type=int)
    ap.add_argument("--d-kv-gib", type=float)
    ap.add_argument("--d-budget-s", type=float)
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, DLITE)  # default: the drafter's own K
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
