#!/usr/bin/env python3
"""Build, check and time the DLite CUDA ops (format dlite_v1) on one GPU, in one short run.

    python benchmarks/gpu_kernels.py                 # JIT-build csrc/, check, time; writes $OUT
    python benchmarks/gpu_kernels.py --build installed   # use an installed vllm_dlite._C
    python benchmarks/gpu_kernels.py --dry-run --out /tmp/x   # no CUDA: stages + calculated cost

Stages (GPU; ~1-2 minutes, most of it the JIT build):
 1. build ``csrc/`` with ``torch.utils.cpp_extension.load`` (or use an installed
    ``vllm_dlite._C``) and require the dispatcher to report the CUDA path;
 2. measure the device-to-device copy bandwidth (the practical ceiling, ~4.2 TB/s on an H200);
 3. correctness, fresh random inputs per check, outputs and scratch poisoned
    (DLITE_POISON_OUTPUTS=1): draft_attention vs the reference by relative error (G = 1 and 2
    layouts); sequential_head for G = 1 and 2, several batches and k (tokens drafted per round), against the
    reference teacher-forced with the op's own drafts (logits by relative error, ids identical
    except near-exact ties, ids == argmax(logits)); CUDA-graph replay == eager (bitwise);
 4. timing at Qwen3-8B shapes (H 4096, r 512, V 151936, K 7, bf16, L 14, h_q 32, h_kv 8, D 128):
    the head per round (all K steps, CUDA-graph replay) at each batch, with the achieved bandwidth
    (bytes the round must move / time, like gpt-fast) against the measured copy bandwidth, and the
    draft attention per call; the reference beside both;
 5. writes gpu_kernels.json and gpu_kernels.md to --out (default $OUT, else ./gpu_kernels_out).

Without CUDA (or with --dry-run) it prints "no CUDA", the stages it would run, and the calculated
head cost at Qwen3-8B shapes (the bandwidth floor from the 4.2 TB/s copy bandwidth) next to the old
head's measured 2.44 ms per round; a CPU smoke check runs the dispatcher at tiny shapes.
Exit status 1 on any correctness failure (and the tables still get written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from vllm_dlite import ops  # noqa: E402
from vllm_dlite.ops import cuda_ops, dispatch, reference  # noqa: E402

COPY_TBPS_H200 = 4.2  # device-to-device copy bandwidth measured on the H200s here (4.235 TB/s)
OLD_HEAD_MS = 2.44  # old head (lm_head variant), batch 1, per K = 7 round, CUDA graph:
#                     benchmarks/results/gpu_kernels_h200.md
QWEN3_8B = dict(H=4096, r=512, V=151936, K=7, L=14, n=5, Hq=32, Hkv=8, D=128, theta=1e6)
BATCHES = [1, 2, 4, 8, 16, 32, 64]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HEAD_TOL = 5e-3  # relative error of the logits (both sides are rounded to bf16/fp16)
TIE_REL = 2 * 2**-7  # an id mismatch is a tie when the reference's gap is within ~2 bf16 ulp

# draft_attention checks: (b, G, B, L, Hq, Hkv, D, dtype)
ATTN_CASES = [
    (1, 1, 8, 14, 32, 8, 128, "bf16"),    # Qwen3-8B, G = 1: Q = 8
    (64, 2, 8, 14, 32, 8, 128, "bf16"),   # Qwen3-8B, G = 2: Q = 9
    (3, 2, 8, 14, 32, 8, 128, "fp16"),
    (5, 1, 4, 1, 8, 8, 64, "fp32"),
    (2, 2, 16, 36, 16, 4, 256, "bf16"),   # > 48 KiB shared memory
]
# sequential_head checks: (b, K, H, r, V, G, k, dtype)
HEAD_CASES = [
    (1, 7, 4096, 512, 151936, 1, 7, "bf16"),    # Qwen3-8B, batch 1
    (1, 7, 4096, 512, 151936, 2, 7, "bf16"),    # G = 2 (primed)
    (33, 7, 4096, 512, 151936, 2, 4, "bf16"),   # 5 n-tiles padded to 8, k < K
    (70, 7, 4096, 512, 151936, 1, 2, "bf16"),   # two launches (64 + 6)
    (9, 3, 320, 320, 1001, 2, 3, "fp16"),       # r % 128 != 0, V % 16 != 0, k-slices of 64
    (17, 5, 2560, 320, 151936, 1, 1, "bf16"),   # Qwen3-4B widths, one step
]


# ============================================================================ calculation
def head_round_bytes(S: dict, b: int, G: int = 1) -> dict[str, int]:
    """Bytes one greedy round of the head must move (bf16 weights, fp32 logits written).

    Every step reads all of W_o (step k needs t_{k-1}, the argmax over the whole vocabulary of
    step k-1, so no two steps can share a pass over W_o), plus W_s and W_f, b rows of P and d."""
    V, r, H, K = S["V"], S["r"], S["H"], S["K"]
    steps_s = K + (1 if G > 1 else 0)  # state updates (priming is one more)
    parts = dict(
        w_o=K * V * r * 2,
        w_f=K * r * (r + H) * 2,
        w_s=steps_s * (2 * r) * (2 * r) * 2,
        biases=(steps_s * 2 * r + K * r) * 2,
        p_rows=steps_s * b * r * 2,
        d=K * b * H * 2,
        logits=K * b * V * 4,
    )
    parts["total"] = sum(parts.values())
    return parts


def calculated(S: dict, batches: list[int], tbps: float = COPY_TBPS_H200) -> dict[str, Any]:
    rows = []
    for b in batches:
        by = head_round_bytes(S, b)
        rows.append(dict(batch=b, bytes=by["total"],
                         floor_w_o_ms=by["w_o"] / (tbps * 1e12) * 1e3,
                         floor_all_ms=by["total"] / (tbps * 1e12) * 1e3))
    return dict(tbps=tbps, w_o_bytes=S["V"] * S["r"] * 2, K=S["K"], old_measured_ms=OLD_HEAD_MS,
                old_floor_ms=S["K"] * S["V"] * S["H"] * 2 / (tbps * 1e12) * 1e3, rows=rows)


def print_calculation(calc: dict[str, Any]) -> None:
    K, tb = calc["K"], calc["tbps"]
    w_o_mb = calc["w_o_bytes"] / 1e6
    r1 = calc["rows"][0]
    print(f"calculated head cost at Qwen3-8B shapes ({tb} TB/s copy bandwidth):")
    print(f"  floor per round = K x V x r x 2 B / BW = {K} x {w_o_mb:.1f} MB / {tb} TB/s "
          f"= {r1['floor_w_o_ms']:.3f} ms  (W_o only)")
    for r in calc["rows"]:
        print(f"  batch {r['batch']:3d}: {r['bytes'] / 1e6:8.1f} MB per round (W_o, W_f, W_s, P "
              f"rows, d, fp32 logits) -> {r['floor_all_ms']:.3f} ms")
    print(f"  old head (lm_head variant): measured {calc['old_measured_ms']:.2f} ms per round at "
          f"batch 1 (its own floor {calc['old_floor_ms']:.2f} ms); new floor "
          f"{r1['floor_w_o_ms']:.3f} ms = {calc['old_measured_ms'] / r1['floor_w_o_ms']:.1f}x less",
          flush=True)


def stages(args: argparse.Namespace) -> list[str]:
    return [
        f"build: {args.build} ({'torch.utils.cpp_extension.load of csrc/' if args.build == 'jit' else 'vllm_dlite._C'})",
        "copy bandwidth: 2 GiB device-to-device copy",
        f"check draft_attention vs reference: {len(ATTN_CASES)} cases (b, G, B, L, Hq, Hkv, D, dtype) "
        f"= {ATTN_CASES}",
        f"check sequential_head vs teacher-forced reference: {len(HEAD_CASES)} cases "
        f"(b, K, H, r, V, G, k, dtype) = {HEAD_CASES}",
        "check CUDA graph replay == eager (both ops)",
        f"time sequential_head per round (K = 7, CUDA graph) at Qwen3-8B shapes, batches "
        f"{args.batch_list}, op and reference, achieved bandwidth vs copy bandwidth",
        "time draft_attention per call (Q = 9, L = 14) at batches 1 and 64, op and reference",
    ]


# ============================================================================ inputs
def attention_inputs(b, G, B, L, Hq, Hkv, D, dtype, device, gen, theta=1e6):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    Q = G + B - 1
    positions = torch.tensor([max(G - 2, 0)] * L + list(range(Q)), device=device)
    cos, sin = reference.rope_cos_sin(positions, D, theta, device=device, dtype=dtype)
    return [rnd(b, Q, Hq, D), rnd(b, L, Hkv, D), rnd(b, L, Hkv, D), rnd(b, Q, Hkv, D),
            rnd(b, Q, Hkv, D), cos, sin, D**-0.5]


def head_inputs(b, K, H, r, V, G, dtype, device, gen):
    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    ids = torch.randint(0, V, (2, b), generator=gen, device=device)
    return [rnd(b, K, H), ids[0], ids[1] if G > 1 else None, rnd(V, r, std=0.5),
            rnd(2 * r, 2 * r, std=(2 * r) ** -0.5), rnd(2 * r, std=0.1),
            rnd(r, r + H, std=(r + H) ** -0.5), rnd(r, std=0.1), rnd(V, r, std=r**-0.5)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ============================================================================ checks
class Checker:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, **info: Any) -> None:
        self.results.append(dict(check=name, ok=bool(ok), **info))
        status = "ok  " if ok else "FAIL"
        details = ", ".join(f"{k}={_fmt(v)}" for k, v in info.items())
        print(f"[{status}] {name}: {details}", flush=True)

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a crash is a failure of that check, not of the script
            traceback.print_exc()
            self.add(name, False, error=f"{type(exc).__name__}: {exc}")

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.results if not r["ok"]]


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)



def check_attention(chk: Checker, case, device, gen) -> None:
    b, G, B, L, Hq, Hkv, D, dt = case
    dtype = DTYPES[dt]
    name = f"draft_attention b={b} G={G} Q={G + B - 1} L={L} Hq={Hq} Hkv={Hkv} D={D} {dt}"
    args = attention_inputs(b, G, B, L, Hq, Hkv, D, dtype, device, gen)
    out = ops.draft_attention(*args)
    route = dispatch._last.get("draft_attention", "?")
    ref = reference.draft_attention(*args)
    torch.cuda.synchronize()
    err = rel_err(out.float(), ref.float())
    n_bad = int((~torch.isfinite(out)).sum())
    ok = (route == "cuda" and out.dtype == ref.dtype and out.shape == ref.shape and n_bad == 0
          and err <= ATTN_TOL[dtype])
    chk.add(name, ok, rel_err=err, tol=ATTN_TOL[dtype], nonfinite=n_bad, route=route)


def check_head(chk: Checker, case, device, gen) -> None:
    b, K, H, r, V, G, k, dt = case
    dtype = DTYPES[dt]
    name = f"sequential_head b={b} K={K} H={H} r={r} V={V} G={G} k={k} {dt}"
    args = head_inputs(b, K, H, r, V, G, dtype, device, gen)
    d, anchor, prime, *w = args
    ids, logits = ops.sequential_head(*args, k=k)
    route = dispatch._last.get("sequential_head", "?")
    forced = torch.zeros(b, K, dtype=torch.long, device=device)
    forced[:, :k] = ids.clamp(0, V - 1)
    # the reference fed with the op's own drafts: the same inputs at every step
    ref_logits = reference.sequential_head_teacher_forced(d, anchor, prime, forced, *w)[:, :k]
    free_ids, _ = reference.sequential_head(*args, k=k)
    torch.cuda.synchronize()
    n_bad = int((~torch.isfinite(logits)).sum()) + int(((ids < 0) | (ids >= V)).sum())
    err = rel_err(logits, ref_logits)
    self_argmax = bool(torch.equal(ids, logits.argmax(-1)))
    mism = ids != ref_logits.argmax(-1)
    n_mism = int(mism.sum())
    ties = 0
    if n_mism:
        top = ref_logits.max(-1).values
        at = ref_logits.gather(-1, ids.clamp(0, V - 1)[..., None])[..., 0]
        ties = int(((top - at)[mism] <= TIE_REL * top.abs()[mism]).sum())
    agree = float((ids == free_ids).float().mean())
    ok = (route == "cuda" and n_bad == 0 and err <= HEAD_TOL and self_argmax and ties == n_mism
          and ids.shape == (b, k) and logits.shape == (b, k, V))
    chk.add(name, ok, logits_rel_err=err, tol=HEAD_TOL, bad=n_bad,
            ids_vs_forced_ref=f"{n_mism} differ ({ties} near-ties)", self_argmax=self_argmax,
            free_run_agreement=agree, route=route)


def check_graph(chk: Checker, device, gen) -> None:
    """CUDA-graph capture of both ops: replay on new inputs == eager (bitwise)."""
    S = QWEN3_8B
    a_args = attention_inputs(4, 2, 8, 14, 32, 8, 128, torch.bfloat16, device, gen)
    h_args = head_inputs(8, S["K"], S["H"], S["r"], S["V"], 2, torch.bfloat16, device, gen)

    def both():
        return (ops.draft_attention(*a_args),) + tuple(ops.sequential_head(*h_args))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        both()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = both()
    a_args[0].normal_(generator=gen)
    h_args[0].normal_(generator=gen)
    g.replay()
    eager = both()
    torch.cuda.synchronize()
    chk.add("cuda graph capture + replay == eager (bitwise)",
            all(torch.equal(x, y) for x, y in zip(static, eager)))


# ============================================================================ timing
def time_ms(fn: Callable[[], Any], device, iters: int, warmup: int = 1,
            graph: bool = False) -> tuple[float, str]:
    """Median milliseconds per call of ``fn`` and how it was timed: the one timing helper of the GPU
    benchmarks (this script's ops and ``gpu_shapes.py``'s Qwen3-8B-shape steps).

    On CUDA: CUDA events around each call; ``graph=True`` captures ``fn`` in a CUDA graph (after two
    warm-up calls on a side stream) and times its replays, or eager launches when the capture
    fails (``how`` says so). Elsewhere: wall time (``"cpu wall"``)."""
    if device.type != "cuda":
        for _ in range(max(warmup, 1)):
            fn()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples), "cpu wall"
    run, how = fn, "eager"
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, how = g.replay, "cuda graph"
        except Exception as exc:  # noqa: BLE001 - timed eagerly instead, and said so
            how = f"eager (graph capture failed: {exc!r:.120})"
            torch.cuda.synchronize()
    for _ in range(max(warmup, 1)):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples), how


def copy_bandwidth_tbps(device) -> float:
    """Device-to-device copy of 2 GiB: (bytes read + written) / time."""
    n = 1 << 30  # bf16 elements = 2 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), device, iters=10, warmup=3, graph=False)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def time_head(batches: list[int], device, gen, iters: int, copy_tbps: float) -> list[dict]:
    S = QWEN3_8B
    rows = []
    for b in batches:
        args = head_inputs(b, S["K"], S["H"], S["r"], S["V"], 1, torch.bfloat16, device, gen)
        t_op, how = time_ms(lambda: ops.sequential_head(*args), device, iters, 3, graph=True)
        route = dispatch._last.get("sequential_head")
        t_ref, _ = time_ms(lambda: reference.sequential_head(*args), device, max(3, iters // 3), 2,
                           graph=True)
        by = head_round_bytes(S, b)
        w_o_tbps = by["w_o"] / (t_op * 1e-3) / 1e12
        all_tbps = by["total"] / (t_op * 1e-3) / 1e12
        floor_ms = by["total"] / (copy_tbps * 1e12) * 1e3
        rows.append(dict(op="sequential_head", batch=b, op_ms=t_op, ref_ms=t_ref,
                         speedup=t_ref / t_op, bytes=by["total"], w_o_tbps=w_o_tbps,
                         achieved_tbps=all_tbps, pct_copy=100 * all_tbps / copy_tbps,
                         floor_ms=floor_ms, route=route, how=how))
        # gpt-fast style: time, bandwidth achieved, share of the ceiling
        print(f"  head b={b:3d}: {t_op:.3f} ms/round (reference {t_ref:.3f} ms), bandwidth "
              f"achieved {all_tbps:.2f} TB/s ({100 * all_tbps / copy_tbps:.0f} % of copy), W_o "
              f"alone {w_o_tbps:.2f} TB/s, floor {floor_ms:.3f} ms", flush=True)
        del args
    return rows


def time_attention(device, gen, iters: int) -> list[dict]:
    S = QWEN3_8B
    rows = []
    for b in (1, 64):
        args = attention_inputs(b, 2, 8, S["L"], S["Hq"], S["Hkv"], S["D"], torch.bfloat16,
                                device, gen)
        t_op, how = time_ms(lambda: ops.draft_attention(*args), device, iters, 3, graph=True)
        route = dispatch._last.get("draft_attention")
        t_ref, _ = time_ms(lambda: reference.draft_attention(*args), device, iters, 3, graph=True)
        # inputs + output (the size of q)
        nbytes = sum(a.numel() * a.element_size() for a in args[:5]) + args[0].numel() * 2
        rows.append(dict(op="draft_attention", batch=b, op_ms=t_op, ref_ms=t_ref,
                         speedup=t_ref / t_op, bytes=nbytes,
                         achieved_tbps=nbytes / (t_op * 1e-3) / 1e12, route=route, how=how))
        print(f"  attention b={b:3d}: {t_op * 1e3:.1f} us (reference {t_ref * 1e3:.1f} us)",
              flush=True)
    return rows


# ============================================================================ output
def markdown(meta: dict[str, Any], calc: dict[str, Any], checks: list[dict[str, Any]],
             rows: list[dict[str, Any]]) -> str:
    out = ["# DLite CUDA ops (dlite_v1): checks and timings", ""]
    for k, v in meta.items():
        out.append(f"- **{k}**: {v}")
    out += ["", "## Calculated head cost (Qwen3-8B shapes, bf16, K = 7)", "",
            f"Floor per round = K x V x r x 2 B / {calc['tbps']} TB/s = "
            f"{calc['rows'][0]['floor_w_o_ms']:.3f} ms (W_o only); old head measured "
            f"{calc['old_measured_ms']} ms at batch 1.", "",
            "| batch | bytes per round (MB) | floor (ms) |", "| --- | --- | --- |"]
    for r in calc["rows"]:
        out.append(f"| {r['batch']} | {r['bytes'] / 1e6:.1f} | {r['floor_all_ms']:.3f} |")
    out += ["", "## Correctness", "", "| check | ok | details |", "| --- | --- | --- |"]
    for c in checks:
        details = "; ".join(f"{k}={_fmt(v)}" for k, v in c.items() if k not in ("check", "ok"))
        out.append(f"| {c['check']} | {'yes' if c['ok'] else '**NO**'} | {details} |")
    if rows:
        out += ["", "## Timings (median, CUDA-graph replay)", "",
                "| op | batch | op ms | reference ms | speedup | achieved TB/s | % of copy BW | "
                "floor ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            pc, fl = r.get("pct_copy"), r.get("floor_ms")
            out.append(
                f"| {r['op']} | {r['batch']} | {r['op_ms']:.4f} | {r['ref_ms']:.4f} | "
                f"{r['speedup']:.2f}x | {r['achieved_tbps']:.3f} | "
                f"{'' if pc is None else f'{pc:.1f}'} | {'' if fl is None else f'{fl:.3f}'} |")
        out += ["", "Achieved TB/s for sequential_head = bytes a round must move (K reads of W_o, "
                "W_f, W_s; P rows, d, fp32 logits) / time; for draft_attention = inputs + output "
                "/ time.", ""]
    return "\n".join(out)


def build(mode: str, build_dir: Path) -> str:
    """Make the CUDA kernels available; returns a one-line description."""
    if mode in ("installed", "auto"):
        cuda_ops.load_extension()
        if cuda_ops.cuda_kernels_registered():
            return f"installed {cuda_ops.EXTENSION}"
        if mode == "installed":
            raise RuntimeError(f"{cuda_ops.EXTENSION} not importable: {cuda_ops.load_extension()}")
    if mode == "pip":
        env = dict(os.environ, DLITE_BUILD_CUDA="1")
        cmd = [sys.executable, "-m", "pip", "install", "-e", str(ROOT), "--no-build-isolation",
               "--no-deps"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
        cuda_ops._extension_tried = False  # retry the import now that it is built
        cuda_ops.load_extension()
        dispatch.refresh_backend()
        if not cuda_ops.cuda_kernels_registered():
            raise RuntimeError(f"pip build done but {cuda_ops.EXTENSION} did not load")
        return "pip install -e . (DLITE_BUILD_CUDA=1)"
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    build_dir.mkdir(parents=True, exist_ok=True)
    csrc = ROOT / "csrc"
    load(
        name="dlite_C_jit",
        sources=[str(csrc / "binding.cpp"), str(csrc / "draft_attention.cu"),
                 str(csrc / "sequential_head.cu")],
        extra_include_paths=[str(csrc)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=True,
    )
    dispatch.refresh_backend()
    return f"JIT torch.utils.cpp_extension.load (sm_{arch}) in {build_dir}"


# ============================================================================ main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_kernels_out"),
                   help="output directory (default: $OUT, else ./gpu_kernels_out)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU work: list the stages, print the calculated cost, CPU smoke check")
    p.add_argument("--build", choices=["auto", "jit", "pip", "installed"], default="jit",
                   help="how to get the CUDA kernels (default: JIT-build csrc/)")
    p.add_argument("--build-dir", type=Path, default=Path("/tmp/dlite_jit_build"))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="comma-separated head timing batches")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median reported)")
    p.add_argument("--seed", type=int, default=None, help="base seed (default: from the clock)")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    return args


def dry_run(args: argparse.Namespace, meta: dict[str, Any], calc: dict[str, Any]) -> int:
    """No CUDA: the stages a GPU run would do, the calculated cost, and a CPU smoke check of the
    dispatcher at tiny shapes (route and shapes only: on CPU every call is the reference)."""
    why = "--dry-run" if args.dry_run else "torch.cuda.is_available() is False"
    print(f"no CUDA ({why}): nothing is built, checked or timed. A GPU run would do:")
    for i, s in enumerate(stages(args), 1):
        print(f"  {i}. {s}")
    print_calculation(calc)
    chk = Checker()
    gen = torch.Generator().manual_seed(0)
    a_args = attention_inputs(2, 2, 4, 3, 4, 2, 32, torch.float32, "cpu", gen, 1e4)
    out = ops.draft_attention(*a_args)
    chk.add("cpu smoke: draft_attention via dispatcher", out.shape == a_args[0].shape,
            route=dispatch._last.get("draft_attention"))
    h_args = head_inputs(2, 4, 256, 64, 1000, 2, torch.bfloat16, "cpu", gen)
    ids, logits = ops.sequential_head(*h_args, k=3)
    chk.add("cpu smoke: sequential_head via dispatcher",
            ids.shape == (2, 3) and logits.shape == (2, 3, 1000),
            route=dispatch._last.get("sequential_head"))
    meta["backend"] = ops.backend_report().splitlines()[0]
    write(args.out, meta, calc, stages(args), chk.results, [])
    return 1 if chk.failed else 0


def write(out: Path, meta, calc, stage_list, checks, rows) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(
        dict(meta=meta, stages=stage_list, calculated=calc, checks=checks, timings=rows),
        indent=2, default=str))
    (out / "gpu_kernels.md").write_text(markdown(meta, calc, checks, rows))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    meta: dict[str, Any] = dict(torch=torch.__version__, seed=seed, shapes=QWEN3_8B)
    calc = calculated(QWEN3_8B, args.batch_list or BATCHES)
    if args.dry_run or not torch.cuda.is_available():
        meta["dry_run"] = True
        return dry_run(args, meta, calc)

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 matmuls stay fp32
    device = torch.device("cuda")
    chk = Checker()
    meta.update(dry_run=False, gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    print_calculation(calc)
    t0 = time.time()
    try:
        meta["build"] = build(args.build, args.build_dir)
    except Exception as exc:
        traceback.print_exc()
        chk.add("build", False, error=f"{type(exc).__name__}: {exc}")
        meta["build"] = "FAILED"
    meta["build_s"] = round(time.time() - t0, 1)
    report = ops.backend_report().splitlines()[0]
    meta["backend"] = report
    print("backend:", report, flush=True)
    if not report.startswith("cuda"):
        chk.add("backend is cuda", False, report=report)

    copy_tbps = copy_bandwidth_tbps(device)
    meta["copy_bandwidth_TBps"] = round(copy_tbps, 3)
    print(f"copy bandwidth: {copy_tbps:.3f} TB/s", flush=True)
    calc_measured = calculated(QWEN3_8B, args.batch_list or BATCHES, round(copy_tbps, 3))
    meta["floor_per_round_at_measured_copy_ms"] = round(calc_measured["rows"][0]["floor_w_o_ms"], 4)

    gen = torch.Generator(device=device)
    os.environ["DLITE_POISON_OUTPUTS"] = "1"  # NaN / -1 in outputs and scratch before launch
    for i, case in enumerate(ATTN_CASES):
        gen.manual_seed(seed * 1000 + i)  # fresh inputs per check
        chk.run(f"draft_attention {case}", lambda: check_attention(chk, case, device, gen))
    for i, case in enumerate(HEAD_CASES):
        gen.manual_seed(seed * 1000 + 100 + i)
        chk.run(f"sequential_head {case}", lambda: check_head(chk, case, device, gen))
    os.environ["DLITE_POISON_OUTPUTS"] = "0"
    gen.manual_seed(seed * 1000 + 999)
    chk.run("graph", lambda: check_graph(chk, device, gen))
    torch.cuda.empty_cache()

    rows: list[dict[str, Any]] = []
    if not args.skip_timing:
        gen.manual_seed(seed)
        try:
            rows = time_head(args.batch_list, device, gen, args.iters, copy_tbps)
            rows += time_attention(device, gen, args.iters)
        except Exception as exc:
            traceback.print_exc()
            chk.add("timing", False, error=f"{type(exc).__name__}: {exc}")
    meta["backend_report"] = ops.backend_report().replace("\n", " | ")
    meta["wall_s"] = round(time.time() - t_start, 1)
    write(args.out, meta, calc, stages(args), chk.results, rows)
    print()
    print((args.out / "gpu_kernels.md").read_text())
    if chk.failed:
        print(f"FAILED: {len(chk.failed)} check(s): " + "; ".join(c["check"] for c in chk.failed),
              file=sys.stderr)
        return 1
    print(f"all {len(chk.results)} checks passed; wrote {args.out}/gpu_kernels.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
