#!/usr/bin/env python3
"""Build, check and time the DLite CUDA ops against the PyTorch reference (one GPU, < 8 minutes).

    python benchmarks/gpu_kernels.py                 # JIT-build csrc/, check, time; writes $OUT
    python benchmarks/gpu_kernels.py --build installed   # use an installed vllm_dlite._C
    python benchmarks/gpu_kernels.py --dry-run --out /tmp/x   # CPU: reference only, tiny shapes

Steps (GPU):
 1. build ``csrc/`` with ``torch.utils.cpp_extension.load`` (or ``pip install -e .`` with
    DLITE_BUILD_CUDA=1, or use an installed ``vllm_dlite._C``) and require the dispatcher to
    report the CUDA path;
 2. measure the device-to-device copy bandwidth (the practical ceiling);
 3. correctness: every check draws fresh random inputs, runs the op with poisoned outputs and
    scratch (DLITE_POISON_OUTPUTS=1: NaN / -1), and compares with the reference on the same GPU:
    draft_attention by relative error per dtype; sequential_head by teacher-forcing the reference
    on the op's own drafts (same inputs at every step), then logits by relative error and ids by
    "identical except near-exact ties" (the reference's logit at the op's id within 2 ulp of the
    max); also ids == argmax(logits), CUDA-graph replay == eager (bitwise), torch.compile traces;
 4. timing at Qwen3-8B shapes (hidden 4096, L 14, K 7, rank 512, vocab 151936, 32/8 heads of
    128) for each batch, eager and CUDA-graph replay, op vs reference; the head's achieved lm_head
    bandwidth = K * V * H * 2 bytes / time, against the measured copy bandwidth and 4.8 TB/s;
 5. writes gpu_kernels.json and gpu_kernels.md to --out (default $OUT, else ./gpu_kernels_out).
Exit status 1 on any correctness failure (and the table still gets written).
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

DATASHEET_TBPS = 4.8  # H200 HBM3e, vendor datasheet

QWEN3_8B = dict(H=4096, L=14, K=7, r=512, V=151936, Hq=32, Hkv=8, D=128, theta=1e6, eps=1e-6)
TINY = dict(H=256, L=3, K=4, r=32, V=1000, Hq=4, Hkv=2, D=32, theta=1e4, eps=1e-6)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# relative-error thresholds (||op - ref|| / ||ref||): outputs are rounded to the dtype, so the two
# sides differ by at most ~1 ulp where fp32 accumulation order moves a value across a boundary.
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HEAD_TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
TIE_ULPS = 2  # an id mismatch is a tie when the reference's gap is within this many ulps

# draft_attention checks: (B, K, L, Hq, Hkv, D, dtype)
ATTN_CASES = [
    (1, 7, 14, 32, 8, 128, "bf16"),    # Qwen3-8B, batch 1
    (64, 7, 14, 32, 8, 128, "bf16"),   # Qwen3-8B, batch 64
    (3, 7, 14, 32, 8, 128, "fp16"),
    (5, 4, 1, 8, 8, 64, "fp32"),       # feature mode (L = 1), no GQA
    (7, 3, 2, 4, 1, 32, "bf16"),       # MQA, D = 32
    (2, 16, 36, 16, 4, 256, "bf16"),   # D = 256, > 48 KiB shared memory
    (2, 16, 100, 8, 2, 128, "fp16"),   # long feature list, > 48 KiB shared memory
]
# sequential_head checks: (B, K, H, r, V, dtype)
HEAD_CASES = [
    (1, 7, 4096, 512, 151936, "bf16"),   # Qwen3-8B, batch 1 (NT = 1)
    (33, 7, 4096, 512, 151936, "bf16"),  # NT = 8 with padded batch rows
    (70, 3, 4096, 512, 151936, "bf16"),  # two batch chunks (64 + 6)
    (3, 5, 256, 320, 1000, "bf16"),      # r not a multiple of 128, V not a multiple of 16
    (17, 2, 512, 64, 50003, "fp16"),     # NT = 4, fp16
    (9, 1, 1024, 128, 4099, "bf16"),     # K = 1, NT = 2
]
TINY_ATTN_CASES = [(2, 4, 3, 4, 2, 32, "fp32"), (3, 4, 1, 4, 4, 32, "bf16")]
TINY_HEAD_CASES = [(2, 4, 256, 32, 1000, "bf16")]


# ============================================================================ inputs
def attention_inputs(B, K, L, Hq, Hkv, D, dtype, device, gen, theta=1e6):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    cos, sin = reference.rope_cos_sin(K + 1, D, theta, device=device)
    return dict(
        q=rnd(B, K, Hq, D), k_feat=rnd(B, L, Hkv, D), v_feat=rnd(B, L, Hkv, D),
        k_block=rnd(B, K, Hkv, D), v_block=rnd(B, K, Hkv, D), cos=cos, sin=sin, scale=D**-0.5,
    )


def head_inputs(B, K, H, r, V, dtype, device, gen, eps=1e-6):
    def rnd(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=gen, device=device) * std + mean).to(dtype)

    return dict(
        h=rnd(B, K, H),
        anchor_ids=torch.randint(0, V, (B,), generator=gen, device=device),
        embed_weight=rnd(V, H),
        w_in=rnd(r, H, std=H**-0.5),
        w_state=rnd(r, r, std=r**-0.5),
        w_out=rnd(H, r, std=r**-0.5),
        norm_weight=rnd(H, std=0.1, mean=1.0),
        lm_head_weight=rnd(V, H, std=0.02),
        eps=eps,
    )


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


def check_attention(chk: Checker, case, device, gen, use_op: bool) -> None:
    B, K, L, Hq, Hkv, D, dt = case
    dtype = DTYPES[dt]
    name = f"draft_attention B={B} K={K} L={L} Hq={Hq} Hkv={Hkv} D={D} {dt}"
    inp = attention_inputs(B, K, L, Hq, Hkv, D, dtype, device, gen)
    args = [inp[k] for k in ("q", "k_feat", "v_feat", "k_block", "v_block", "cos", "sin")]
    out = ops.draft_attention(*args, inp["scale"])  # through the dispatcher
    route = dispatch._last.get("draft_attention", "?")
    ref = reference.draft_attention(*args, inp["scale"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    err = rel_err(out.float(), ref.float())
    n_bad = int((~torch.isfinite(out)).sum())
    ok = out.dtype == ref.dtype and out.shape == ref.shape and n_bad == 0 and err <= ATTN_TOL[dtype]
    if use_op:
        ok = ok and route == "cuda"
    chk.add(name, ok, rel_err=err, tol=ATTN_TOL[dtype], nonfinite=n_bad, route=route)


def check_head(chk: Checker, case, device, gen, use_op: bool) -> None:
    B, K, H, r, V, dt = case
    dtype = DTYPES[dt]
    name = f"sequential_head B={B} K={K} H={H} r={r} V={V} {dt}"
    inp = head_inputs(B, K, H, r, V, dtype, device, gen)
    args = [inp[k] for k in ("h", "anchor_ids", "embed_weight", "w_in", "w_state", "w_out",
                             "norm_weight", "lm_head_weight")]
    ids, logits = ops.sequential_head(*args, inp["eps"])
    route = dispatch._last.get("sequential_head", "?")
    # reference fed with the op's own drafts: the same inputs at every step
    ref_ids, ref_logits = reference.sequential_head(*args, inp["eps"], forced_ids=ids.clamp(0, V - 1))
    free_ids, _ = reference.sequential_head(*args, inp["eps"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    n_bad = int((~torch.isfinite(logits)).sum()) + int(((ids < 0) | (ids >= V)).sum())
    err = rel_err(logits, ref_logits)
    self_argmax = bool(torch.equal(ids, logits.argmax(-1)))
    mism = ids != ref_ids
    n_mism = int(mism.sum())
    ties = exact = 0
    worst_gap_ulps = 0.0
    if n_mism:
        top = ref_logits.max(-1).values  # [B, K]
        at_id = ref_logits.gather(-1, ids.clamp(0, V - 1)[..., None])[..., 0]
        ulp = torch.finfo(dtype).eps * top.abs().clamp_min(torch.finfo(dtype).tiny)
        gap_ulps = ((top - at_id) / ulp)[mism]
        exact = int((gap_ulps == 0).sum())
        ties = int((gap_ulps <= TIE_ULPS).sum())
        worst_gap_ulps = float(gap_ulps.max())
    agree = float((ids == free_ids).float().mean())
    ok = (n_bad == 0 and err <= HEAD_TOL[dtype] and self_argmax and ties == n_mism
          and ids.dtype == torch.int64 and logits.shape == (B, K, V))
    if use_op:
        ok = ok and route == "cuda"
    chk.add(name, ok, logits_rel_err=err, tol=HEAD_TOL[dtype], bad=n_bad, ids_vs_forced_ref=
            f"{n_mism} differ ({exact} exact ties, {ties} within {TIE_ULPS} ulp, worst "
            f"{worst_gap_ulps:.2g} ulp)", self_argmax=self_argmax, free_run_agreement=agree,
            route=route)


def check_graph_and_compile(chk: Checker, device, gen) -> None:
    """CUDA-graph capture (replay == eager, bitwise) and torch.compile tracing of both ops."""
    a_in = attention_inputs(4, 7, 14, 32, 8, 128, torch.bfloat16, device, gen)
    h_in = head_inputs(8, 7, 4096, 512, 151936, torch.bfloat16, device, gen)
    a_args = [a_in[k] for k in ("q", "k_feat", "v_feat", "k_block", "v_block", "cos", "sin")]
    h_args = [h_in[k] for k in ("h", "anchor_ids", "embed_weight", "w_in", "w_state", "w_out",
                                "norm_weight", "lm_head_weight")]

    def both():
        o = ops.draft_attention(*a_args, a_in["scale"])
        i, lg = ops.sequential_head(*h_args, h_in["eps"])
        return o, i, lg

    eager = both()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        both()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        static = both()
    # fresh inputs copied into the captured buffers, then replay vs eager on the same inputs
    a_new = attention_inputs(4, 7, 14, 32, 8, 128, torch.bfloat16, device, gen)
    a_in["q"].copy_(a_new["q"])
    h_in["h"].copy_(torch.randn(h_in["h"].shape, generator=gen, device=device).to(torch.bfloat16))
    g.replay()
    eager = both()
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(static, eager))
    chk.add("cuda graph capture + replay == eager (bitwise)", same)

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    c = compiled()
    torch.cuda.synchronize()
    same_c = all(torch.equal(x, y) for x, y in zip(c, eager))
    chk.add("torch.compile(fullgraph, aot_eager) == eager", same_c)


# ============================================================================ timing
def time_ms(fn: Callable[[], Any], device, iters: int, warmup: int, graph: bool) -> float:
    """Median milliseconds per call (CUDA events; graph=True times CUDA-graph replays)."""
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    run = fn
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(warmup):
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
    return statistics.median(samples)


def copy_bandwidth_tbps(device) -> Optional[float]:
    """Device-to-device copy of 2 GiB: (bytes read + written) / time."""
    if device.type != "cuda":
        return None
    n = 1 << 30  # bf16 elements = 2 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=10, warmup=3, graph=False)
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def time_shapes(shapes: dict, batches: list[int], device, dtype, gen, iters: int, modes: list[str],
                copy_tbps: Optional[float]) -> list[dict[str, Any]]:
    rows = []
    S = shapes
    for B in batches:
        a_in = attention_inputs(B, S["K"], S["L"], S["Hq"], S["Hkv"], S["D"], dtype, device, gen,
                                S["theta"])
        a_args = [a_in[k] for k in ("q", "k_feat", "v_feat", "k_block", "v_block", "cos", "sin")]
        esz = torch.finfo(dtype).bits // 8
        attn_bytes = esz * B * S["D"] * (2 * S["K"] * S["Hq"] + 2 * (S["L"] + S["K"]) * S["Hkv"])
        h_in = head_inputs(B, S["K"], S["H"], S["r"], S["V"], dtype, device, gen, S["eps"])
        h_args = [h_in[k] for k in ("h", "anchor_ids", "embed_weight", "w_in", "w_state", "w_out",
                                    "norm_weight", "lm_head_weight")]
        floor_bytes = S["K"] * S["V"] * S["H"] * esz  # lm_head read once per step
        for mode in modes:
            graph = mode == "graph"
            t_op = time_ms(lambda: ops.draft_attention(*a_args, a_in["scale"]), device, iters, 3,
                           graph)
            t_ref = time_ms(lambda: reference.draft_attention(*a_args, a_in["scale"]), device,
                            iters, 3, graph)
            rows.append(dict(op="draft_attention", batch=B, mode=mode, op_ms=t_op, ref_ms=t_ref,
                             speedup=t_ref / t_op, bytes=attn_bytes,
                             op_tbps=attn_bytes / (t_op * 1e-3) / 1e12,
                             route=dispatch._last.get("draft_attention")))
            t_op = time_ms(lambda: ops.sequential_head(*h_args, h_in["eps"]), device, iters, 2,
                           graph)
            t_ref = time_ms(lambda: reference.sequential_head(*h_args, h_in["eps"]), device,
                            iters, 2, graph)
            tbps = floor_bytes / (t_op * 1e-3) / 1e12
            rows.append(dict(
                op="sequential_head", batch=B, mode=mode, op_ms=t_op, ref_ms=t_ref,
                speedup=t_ref / t_op, bytes=floor_bytes, op_tbps=tbps,
                floor_ms_datasheet=floor_bytes / (DATASHEET_TBPS * 1e12) * 1e3,
                pct_datasheet=100 * tbps / DATASHEET_TBPS,
                pct_copy=(100 * tbps / copy_tbps) if copy_tbps else None,
                route=dispatch._last.get("sequential_head"),
            ))
            print(f"  B={B:3d} {mode:5s} head op {t_op:8.3f} ms  ref {t_ref:8.3f} ms  "
                  f"lm_head {tbps:5.2f} TB/s", flush=True)
        del h_in, h_args, a_in, a_args
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ============================================================================ output
def markdown(meta: dict[str, Any], checks: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    out = ["# DLite CUDA ops: checks and timings", ""]
    for k, v in meta.items():
        out.append(f"- **{k}**: {v}")
    out += ["", "## Correctness", "", "| check | ok | details |", "| --- | --- | --- |"]
    for c in checks:
        details = "; ".join(f"{k}={_fmt(v)}" for k, v in c.items() if k not in ("check", "ok"))
        out.append(f"| {c['check']} | {'yes' if c['ok'] else '**NO**'} | {details} |")
    out += ["", "## Timings (median ms per call)", "",
            "| op | batch | mode | op ms | reference ms | speedup | op TB/s | % of copy BW | "
            "% of 4.8 TB/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pc = r.get("pct_copy")
        pd = r.get("pct_datasheet")
        out.append(
            f"| {r['op']} | {r['batch']} | {r['mode']} | {r['op_ms']:.4f} | {r['ref_ms']:.4f} | "
            f"{r['speedup']:.2f}x | {r['op_tbps']:.3f} | {'' if pc is None else f'{pc:.1f}'} | "
            f"{'' if pd is None else f'{pd:.1f}'} |"
        )
    out += ["", "TB/s for sequential_head = lm_head bytes (K x V x H x 2) / time: the bandwidth "
            "floor of the op; for draft_attention = input + output bytes / time.", ""]
    return "\n".join(out)


# ============================================================================ build
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
                   help="CPU only: reference through the dispatcher at tiny shapes (no build)")
    p.add_argument("--build", choices=["auto", "jit", "pip", "installed"], default="jit",
                   help="how to get the CUDA kernels (default: JIT-build csrc/)")
    p.add_argument("--build-dir", type=Path, default=Path("/tmp/dlite_jit_build"))
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated timing batches")
    p.add_argument("--modes", default="eager,graph", help="timing modes: eager and/or graph")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median reported)")
    p.add_argument("--seed", type=int, default=None, help="base seed (default: from the clock)")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    args.mode_list = [m for m in args.modes.split(",") if m.strip()]
    bad = set(args.mode_list) - {"eager", "graph"}
    if bad:
        p.error(f"unknown --modes {sorted(bad)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 matmuls stay fp32
    torch.backends.cudnn.allow_tf32 = False
    chk = Checker()
    meta: dict[str, Any] = dict(torch=torch.__version__, seed=seed, dry_run=args.dry_run)

    if args.dry_run:
        device = torch.device("cpu")
        shapes, attn_cases, head_cases = TINY, TINY_ATTN_CASES, TINY_HEAD_CASES
        batches = args.batch_list[:2] if args.batch_list else [1]
        meta["build"] = "none (dry run)"
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        shapes, attn_cases, head_cases = QWEN3_8B, ATTN_CASES, HEAD_CASES
        batches = args.batch_list
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
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
    use_op = not args.dry_run
    if use_op and not report.startswith("cuda"):
        chk.add("backend is cuda", False, report=report)

    gen = torch.Generator(device=device)
    if use_op:
        os.environ["DLITE_POISON_OUTPUTS"] = "1"  # NaN / -1 in outputs and scratch before launch
    for i, case in enumerate(attn_cases):
        gen.manual_seed(seed * 1000 + i)  # fresh inputs per check
        chk.run(f"draft_attention {case}", lambda: check_attention(chk, case, device, gen, use_op))
    for i, case in enumerate(head_cases):
        gen.manual_seed(seed * 1000 + 100 + i)
        chk.run(f"sequential_head {case}", lambda: check_head(chk, case, device, gen, use_op))
    os.environ["DLITE_POISON_OUTPUTS"] = "0"
    if use_op:
        gen.manual_seed(seed * 1000 + 999)
        chk.run("graph/compile", lambda: check_graph_and_compile(chk, device, gen))

    copy_tbps = copy_bandwidth_tbps(device)
    meta["copy_bandwidth_TBps"] = None if copy_tbps is None else round(copy_tbps, 3)
    meta["shapes"] = shapes
    rows: list[dict[str, Any]] = []
    if not args.skip_timing:
        dtype = torch.bfloat16
        modes = args.mode_list if use_op else ["eager"]
        gen.manual_seed(seed)
        try:
            rows = time_shapes(shapes, batches, device, dtype, gen, args.iters, modes, copy_tbps)
        except Exception as exc:
            traceback.print_exc()
            chk.add("timing", False, error=f"{type(exc).__name__}: {exc}")
    meta["backend_report"] = ops.backend_report().replace("\n", " | ")
    meta["wall_s"] = round(time.time() - t_start, 1)

    (args.out / "gpu_kernels.json").write_text(
        json.dumps(dict(meta=meta, checks=chk.results, timings=rows), indent=2, default=str)
    )
    md = markdown(meta, chk.results, rows)
    (args.out / "gpu_kernels.md").write_text(md)
    print()
    print(md)
    failed = chk.failed
    if failed:
        print(f"FAILED: {len(failed)} check(s): " + "; ".join(c["check"] for c in failed),
              file=sys.stderr)
        return 1
    print(f"all {len(chk.results)} checks passed; wrote {args.out}/gpu_kernels.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
