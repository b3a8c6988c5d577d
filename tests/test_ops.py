"""Tests of the dispatched DLite ops (format ``dlite_v1``) and the optional CUDA extension.

CPU (always): the dispatcher falls back to the reference and says why; the routing rules pick the
CUDA op exactly for the inputs the kernels handle (a pretend-CUDA fixture); the pure-Python op
schemas + fake impls give the right shapes/dtypes (meta tensors, FakeTensorMode,
torch.library.opcheck, torch.compile); setup.py lists the right sources and skips the extension
cleanly; the GPU script's no-CUDA mode lists its stages and the calculated head cost.
No CPU test compares the reference with itself: on CPU every routed call runs the reference.
nvcc (skipped without it): the .cu sources compile for sm_90 with no spills and no stack frame.
GPU (``@pytest.mark.gpu``, skipped without CUDA + built kernels): kernels vs reference for G = 1
and 2, several batches and k (tokens drafted per round); CUDA graphs; determinism.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_dlite import ops
from vllm_dlite.ops import cuda_ops, dispatch, reference

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
CU_SOURCES = ["draft_attention.cu", "sequential_head.cu"]

torch.set_num_threads(1)


# ------------------------------------------------------------------------------ small inputs
def attn_inputs(b=2, G=1, B=4, L=3, Hq=4, Hkv=2, D=32, dtype=torch.float32, device="cpu", seed=0,
                theta=1e4):
    """Inputs of one draft_attention call in the drafter's layout: Q = g + B - 1 query slots,
    context rows all at max(g - 2, 0), query rows at 0..Q-1."""
    g = torch.Generator(device=device).manual_seed(seed)
    Q = G + B - 1

    def rnd(*s):
        return torch.randn(*s, generator=g, device=device).to(dtype)

    positions = torch.tensor([max(G - 2, 0)] * L + list(range(Q)), device=device)
    cos, sin = reference.rope_cos_sin(positions, D, theta, device=device, dtype=dtype)
    return [rnd(b, Q, Hq, D), rnd(b, L, Hkv, D), rnd(b, L, Hkv, D), rnd(b, Q, Hkv, D),
            rnd(b, Q, Hkv, D), cos, sin, D**-0.5]


def head_inputs(b=2, K=3, H=256, r=64, V=300, dtype=torch.bfloat16, device="cpu", seed=0,
                prime=False):
    """``[d, anchor_ids, prime_ids, P, W_s, b_s, W_f, b_f, W_o]`` of one sequential_head call."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g, device=device) * std).to(dtype)

    ids = torch.randint(0, V, (2, b), generator=g, device=device)
    return [rnd(b, K, H), ids[0], ids[1] if prime else None, rnd(V, r, std=0.5),
            rnd(2 * r, 2 * r, std=(2 * r) ** -0.5), rnd(2 * r, std=0.1),
            rnd(r, r + H, std=(r + H) ** -0.5), rnd(r, std=0.1), rnd(V, r, std=r**-0.5)]


def _has_cuda_kernels() -> bool:
    return torch.cuda.is_available() and dispatch._library_reason() is None


gpu = pytest.mark.gpu
needs_cuda_kernels = pytest.mark.skipif(
    not _has_cuda_kernels(), reason="needs a CUDA GPU and the built vllm_dlite._C"
)


# ------------------------------------------------------------------------------ CPU fallback
def test_cpu_inputs_go_to_the_reference_and_are_reported():
    out = ops.draft_attention(*attn_inputs(G=2))
    assert out.shape == (2, 5, 4, 32)
    ids, logits = ops.sequential_head(*head_inputs(prime=True))
    assert ids.shape == (2, 3) and logits.shape == (2, 3, 300) and logits.dtype == torch.float32
    report = ops.backend_report()
    assert "draft_attention: last call -> reference (inputs on cpu)" in report
    assert "sequential_head: last call -> reference (inputs on cpu)" in report
    if not torch.cuda.is_available():
        assert report.splitlines()[0].startswith("reference (")


def test_report_names_the_missing_extension():
    if cuda_ops.load_extension() is None:
        pytest.skip("vllm_dlite._C is built here")
    assert dispatch._library_reason().startswith("vllm_dlite._C not built")
    assert ops.backend_report().startswith("reference (vllm_dlite._C not built")


def test_malformed_inputs_still_raise_the_reference_error(pretend_cuda):
    q, kc, vc, kq, vq, cos, sin, scale = attn_inputs()
    with pytest.raises(ValueError, match="cos/sin"):
        ops.draft_attention(q, kc, vc, kq, vq, cos[:-1], sin[:-1], scale)
    assert "shape check" in dispatch._last["draft_attention"]
    with pytest.raises(ValueError, match="k_q/v_q"):
        ops.draft_attention(q, kc, vc, kq[:, :-1], vq[:, :-1], cos, sin, scale)
    d, anchor, prime, *w = head_inputs()
    with pytest.raises(ValueError, match="anchor_ids"):
        ops.sequential_head(d, anchor[:1], prime, *w)
    with pytest.raises(ValueError, match="tokens drafted this round"):
        ops.sequential_head(d, anchor, prime, *w, k=4)
    with pytest.raises(ValueError, match="temperature"):
        ops.sequential_head(d, anchor, prime, *w, temperature=-1.0)
    assert "shape check" in dispatch._last["sequential_head"]


# ------------------------------------------------------------------------------ routing rules
@pytest.fixture
def pretend_cuda(monkeypatch):
    """Route as if the inputs were on a GPU with the kernels built. torch.ops.dlite.* has a CPU
    implementation (the reference), so the routed call still runs here."""
    monkeypatch.setattr(dispatch, "_device_reason", lambda tensors: None)
    monkeypatch.setattr(dispatch, "_library_state", None)
    yield
    dispatch.refresh_backend()


@pytest.mark.parametrize("G", [1, 2])
def test_routing_picks_the_attention_op_for_supported_inputs(pretend_cuda, G):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        args = attn_inputs(G=G, dtype=dtype)
        out = ops.draft_attention(*args)
        assert dispatch._last["draft_attention"] == "cuda", dispatch._last
        assert out.shape == args[0].shape and out.dtype == dtype


@pytest.mark.parametrize("prime", [False, True])
@pytest.mark.parametrize("k", [None, 1, 0])
def test_routing_picks_the_head_op_for_greedy_supported_inputs(pretend_cuda, prime, k):
    for dtype in (torch.float16, torch.bfloat16):
        args = head_inputs(dtype=dtype, prime=prime)
        ids, logits = ops.sequential_head(*args, temperature=1e-6, k=k)
        assert dispatch._last["sequential_head"] == "cuda", dispatch._last
        n = 3 if k is None else k
        assert ids.shape == (2, n) and ids.dtype == torch.int64
        assert logits.shape == (2, n, 300) and logits.dtype == torch.float32
    args = head_inputs(prime=prime)
    args[0] = args[0].float()  # d in fp32, head in bf16: the op casts d like the reference
    ops.sequential_head(*args, k=k)
    assert dispatch._last["sequential_head"] == "cuda"


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(D=48), "head_dim 48"),
        (dict(L=300, B=8, D=128), "L + Q too large"),
    ],
)
def test_routing_rejects_unsupported_attention(pretend_cuda, change, reason):
    kw = dict(b=1, B=2, L=2, Hq=2, Hkv=1, D=32)
    kw.update(change)
    ops.draft_attention(*attn_inputs(**kw))
    assert reason in dispatch._last["draft_attention"]


def test_routing_rejects_mixed_attention_dtypes(pretend_cuda):
    args = attn_inputs(dtype=torch.bfloat16)
    args[1] = args[1].float()
    args[2] = args[2].float()
    with pytest.raises(RuntimeError):  # the reference's cat refuses mixed dtypes too
        ops.draft_attention(*args)
    assert "dtype" in dispatch._last["draft_attention"]


def test_routing_rejects_unsupported_head(pretend_cuda):
    cases = [
        (dict(dtype=torch.float32), "output_proj dtype"),
        (dict(r=48), "rank 48"),
        (dict(r=2048, V=50), "rank 2048"),
        (dict(H=96), "hidden size 96"),
    ]
    for kw, reason in cases:
        ops.sequential_head(*head_inputs(**kw))
        assert reason in dispatch._last["sequential_head"], (kw, dispatch._last)

    args = head_inputs()
    ops.sequential_head(*args, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert "sampling" in dispatch._last["sequential_head"]

    args = head_inputs()
    args[4] = args[4].half()  # W_s in fp16, the rest bf16
    with pytest.raises(RuntimeError):  # the reference's linear refuses it too
        ops.sequential_head(*args)
    assert "output_proj's dtype" in dispatch._last["sequential_head"]

    args = head_inputs()
    args[8] = args[8].t().contiguous().t()  # a transposed (non-contiguous) W_o
    ops.sequential_head(*args)
    assert "not contiguous" in dispatch._last["sequential_head"]

    args = head_inputs(prime=True)
    args[2] = args[2].int()
    ops.sequential_head(*args)
    assert "int64" in dispatch._last["sequential_head"]

    args = head_inputs()
    args[3] = args[3][:-1]  # P with fewer rows than W_o
    ops.sequential_head(*args)
    assert "head weight shapes" in dispatch._last["sequential_head"]


def test_routing_rejects_misaligned_inputs(pretend_cuda):
    args = attn_inputs(dtype=torch.bfloat16)
    flat = torch.empty(args[0].numel() + 1, dtype=torch.bfloat16)[1:]  # 2-byte offset
    args[0] = flat.view(args[0].shape).copy_(args[0])
    ops.draft_attention(*args)
    assert "aligned" in dispatch._last["draft_attention"]


# ------------------------------------------------------------------------------ fake impls
def test_ops_are_registered_in_pure_python():
    assert cuda_ops.registration_error() is None
    assert set(cuda_ops.SCHEMAS) == {"draft_attention_v1", "sequential_head_greedy_v1"}
    for name in cuda_ops.SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dlite::{name}", "CPU")
    assert "float scale" in str(torch.ops.dlite.draft_attention_v1.default._schema)
    assert "Tensor? prime_ids" in str(torch.ops.dlite.sequential_head_greedy_v1.default._schema)


def test_fake_impls_on_meta_tensors():
    """Qwen3-8B shapes (the authors' G = 2: Q = 9)."""
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in attn_inputs(b=3, G=2, B=8, L=14, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16)]
    out = torch.ops.dlite.draft_attention_v1(*args)
    assert out.device.type == "meta" and out.shape == (3, 9, 32, 128)
    assert out.dtype == torch.bfloat16

    def meta(*s, dtype=torch.bfloat16):
        return torch.empty(*s, dtype=dtype, device="meta")

    V, r, H = 151936, 512, 4096
    ids, logits = torch.ops.dlite.sequential_head_greedy_v1(
        meta(5, 7, H), meta(5, dtype=torch.long), meta(5, dtype=torch.long), meta(V, r),
        meta(2 * r, 2 * r), meta(2 * r), meta(r, r + H), meta(r), meta(V, r), 4)
    assert ids.shape == (5, 4) and ids.dtype == torch.int64 and ids.device.type == "meta"
    assert logits.shape == (5, 4, V) and logits.dtype == torch.float32


def test_fake_impls_under_fake_tensor_mode():
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                for a in attn_inputs(dtype=torch.float16)]
        out = torch.ops.dlite.draft_attention_v1(*args)
        assert out.shape == args[0].shape and out.dtype == torch.float16
        hargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                 for a in head_inputs(prime=True)]
        ids, logits = torch.ops.dlite.sequential_head_greedy_v1(*hargs, 2)
        assert ids.shape == (2, 2) and logits.shape == (2, 2, 300)


def test_opcheck_cpu():
    torch.library.opcheck(torch.ops.dlite.draft_attention_v1.default, tuple(attn_inputs(G=2)))
    for prime, k in ((False, 3), (True, 2), (True, 0)):
        torch.library.opcheck(torch.ops.dlite.sequential_head_greedy_v1.default,
                              tuple(head_inputs(b=1, prime=prime)) + (k,))


@pytest.mark.parametrize("prime", [False, True])
def test_torch_compile_traces_the_dispatcher(pretend_cuda, prime):
    args = attn_inputs(G=2 if prime else 1)
    hargs = head_inputs(b=1, prime=prime)

    def fn(a, h):
        out = ops.draft_attention(*a)
        ids, logits = ops.sequential_head(*h, k=2)
        return out, ids, logits

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(args, hargs)
    assert got[0].shape == args[0].shape
    assert got[1].shape == (1, 2) and got[2].shape == (1, 2, 300)
    fn(args, hargs)  # eager: records the decisions (traced calls do not)
    assert dispatch._last["draft_attention"] == "cuda"
    assert dispatch._last["sequential_head"] == "cuda"


def test_dispatch_signatures_are_the_reference_signatures():
    import inspect

    for name in ("draft_attention", "sequential_head"):
        assert inspect.signature(getattr(dispatch, name)) == inspect.signature(
            getattr(reference, name)), name


# ------------------------------------------------------------------------------ build
def test_setup_lists_the_csrc_sources():
    tree = ast.parse((ROOT / "setup.py").read_text())
    sources = None
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "sources":
            sources = ast.literal_eval(node.value)
    assert sources is not None
    assert sorted(sources) == sorted(["csrc/binding.cpp"] + [f"csrc/{s}" for s in CU_SOURCES])
    assert sorted(p.name for p in CSRC.glob("*.cu")) == sorted(CU_SOURCES)


def test_setup_skips_the_extension_cleanly():
    env = dict(os.environ)
    env.pop("DLITE_BUILD_CUDA", None)
    if torch.version.cuda is not None:  # CUDA torch: auto mode would build; force the skip
        env["DLITE_BUILD_CUDA"] = "0"
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("0.1.0")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return str(cand) if cand.exists() else None


def _compile_sm90(nvcc: str, src: str, out_dir: Path) -> subprocess.CompletedProcess:
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-c", str(CSRC / src),
           "-o", str(out_dir / (src + ".o")), "-Xptxas", "-v"]
    return subprocess.run(cmd, capture_output=True, text=True)


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {kernel: {registers, stack, spill_stores, spill_loads, smem}}."""
    kernels: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            kernels[name] = {}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            kernels[name].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[name]["registers"] = int(m[1])
            s = re.search(r"(\d+) bytes smem", line)
            kernels[name]["smem"] = int(s[1]) if s else 0
    return kernels


@pytest.mark.slow  # ~20 s of nvcc
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_cuda_sources_compile_for_sm90_without_spills(tmp_path):
    nvcc = _nvcc()
    with ThreadPoolExecutor(len(CU_SOURCES)) as pool:
        results = list(pool.map(lambda s: _compile_sm90(nvcc, s, tmp_path), CU_SOURCES))
    report, all_names = [], []
    for src, res in zip(CU_SOURCES, results):
        log = res.stdout + res.stderr
        assert res.returncode == 0, f"{src} failed to compile:\n{log[-4000:]}"
        assert not re.search(r"\berror\b", log), log[-4000:]
        kernels = parse_ptxas(log)
        assert kernels, f"no ptxas report for {src}:\n{log[-2000:]}"
        all_names += list(kernels)
        for name, k in kernels.items():
            report.append(f"{src}: {name[-60:]} {k}")
            assert k.get("spill_stores") == 0 and k.get("spill_loads") == 0, (name, k)
            assert k.get("stack") == 0, (name, k)  # no local-memory arrays
            assert k.get("registers", 0) <= 255, (name, k)
    # every head variant (bf16/fp16 x 4 batch tiles x 2 W_o vector widths) and every attention
    # variant (3 dtypes x 4 head dims) was compiled
    assert sum("sequential_head_kernel" in n for n in all_names) == 16, all_names
    assert sum("draft_attention_kernel" in n for n in all_names) == 12, all_names
    print("\n".join(report))


def test_cu_sources_do_not_include_torch():
    for src in CU_SOURCES + ["dlite_kernels.h", "dlite_common.cuh"]:
        text = (CSRC / src).read_text()
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", text), src


# ------------------------------------------------------------------------------ GPU script
def test_gpu_script_without_cuda_lists_its_stages_and_the_calculated_cost(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--dry-run", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "no CUDA" in out.stdout
    data = json.loads((tmp_path / "gpu_kernels.json").read_text())
    stages = " ".join(data["stages"])
    for word in ("build", "check", "time"):
        assert word in stages
    calc = data["calculated"]
    # the Qwen3-8B bandwidth floor: K x V x r x 2 bytes of W_o at 4.2 TB/s
    assert calc["w_o_bytes"] == 151936 * 512 * 2
    assert abs(calc["rows"][0]["floor_w_o_ms"] - 7 * 151936 * 512 * 2 / 4.2e12 * 1e3) < 1e-9
    assert 0.25 < calc["rows"][0]["floor_w_o_ms"] < 0.27
    assert calc["old_measured_ms"] == 2.44
    assert data["checks"] and all(c["ok"] for c in data["checks"])
    assert "0.259" in out.stdout and "2.44" in out.stdout


# ------------------------------------------------------------------------------ GPU
@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_draft_attention_matches_reference(dtype, monkeypatch):
    monkeypatch.setenv("DLITE_POISON_OUTPUTS", "1")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for seed, kw in enumerate([dict(b=3, G=1, B=8, L=14, Hq=32, Hkv=8, D=128, theta=1e6),
                               dict(b=64, G=2, B=8, L=14, Hq=32, Hkv=8, D=128, theta=1e6),
                               dict(b=2, G=2, B=4, L=1, Hq=4, Hkv=4, D=64),
                               dict(b=5, G=1, B=3, L=2, Hq=4, Hkv=1, D=32),
                               dict(b=2, G=2, B=16, L=36, Hq=16, Hkv=4, D=256)]):
        args = attn_inputs(dtype=dtype, device="cuda", seed=seed, **kw)
        out = ops.draft_attention(*args)
        assert dispatch._last["draft_attention"] == "cuda"
        ref = reference.draft_attention(*args)
        assert torch.isfinite(out).all()
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err <= tol, (kw, float(err))


def _check_head_against_reference(args, k_arg):
    """The op's drafts vs the reference fed with those same drafts (teacher forcing): logits by
    relative error; ids identical except where the reference's top two logits (near-)tie."""
    d, anchor, prime, *w = args
    b, K, _ = d.shape
    V = w[-1].shape[0]
    ids, logits = ops.sequential_head(*args, k=k_arg)
    assert dispatch._last["sequential_head"] == "cuda"
    k = K if k_arg is None else k_arg
    assert ids.shape == (b, k) and logits.shape == (b, k, V)
    assert torch.isfinite(logits).all() and ((ids >= 0) & (ids < V)).all()
    assert torch.equal(ids, logits.argmax(-1))  # the fused argmax: first index among maxima
    forced = torch.zeros(b, K, dtype=torch.long, device=d.device)
    forced[:, :k] = ids
    ref_logits = reference.sequential_head_teacher_forced(d, anchor, prime, forced, *w)[:, :k]
    err = (logits.double() - ref_logits.double()).norm() / ref_logits.double().norm()
    assert err <= 5e-3, float(err)
    ref_ids = ref_logits.argmax(-1)
    mism = ids != ref_ids
    if mism.any():  # only (near-)exact ties may differ
        top = ref_logits.max(-1).values
        at = ref_logits.gather(-1, ids[..., None])[..., 0]
        assert ((top - at)[mism] <= 2 * 2**-7 * top.abs()[mism]).all()
    # the free-running reference drafts the same tokens up to its first near-tie: at a row's
    # first difference both saw the same tokens, so the reference's gap there must be a tie
    free_ids, free_logits = reference.sequential_head(*args, k=k_arg)
    for row in range(b):
        diff = (free_ids[row] != ids[row]).nonzero()
        if len(diff):
            s = int(diff[0])
            top = free_logits[row, s].max()
            assert top - free_logits[row, s, ids[row, s]] <= 2 * 2**-7 * top.abs(), (row, s)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("prime", [False, True], ids=["G1", "G2"])
@pytest.mark.parametrize("b", [1, 13, 40, 70])
def test_gpu_sequential_head_matches_reference(b, prime, monkeypatch):
    monkeypatch.setenv("DLITE_POISON_OUTPUTS", "1")
    args = head_inputs(b=b, K=7, H=512, r=128, V=5003, device="cuda", seed=b, prime=prime)
    for k in (None, 1, 4):
        _check_head_against_reference(args, k)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_sequential_head_other_shapes(dtype, monkeypatch):
    monkeypatch.setenv("DLITE_POISON_OUTPUTS", "1")
    # r % 128 != 0 (narrow W_o vectors), k-slices of 64, vocab not a multiple of 16
    _check_head_against_reference(
        head_inputs(b=9, K=3, H=320, r=320, V=1001, dtype=dtype, device="cuda", prime=True), None)
    # Qwen3-8B shapes, batch 2
    _check_head_against_reference(
        head_inputs(b=2, K=7, H=4096, r=512, V=151936, dtype=dtype, device="cuda"), None)


@gpu
@needs_cuda_kernels
def test_gpu_sequential_head_is_deterministic():
    args = head_inputs(b=33, K=7, H=512, r=128, V=5003, device="cuda", prime=True)
    first = ops.sequential_head(*args)
    second = ops.sequential_head(*args)
    assert all(torch.equal(x, y) for x, y in zip(first, second))


@gpu
@needs_cuda_kernels
def test_gpu_ops_capture_in_cuda_graphs():
    args = attn_inputs(dtype=torch.bfloat16, device="cuda", b=4, G=2, B=8, L=14, Hq=32, Hkv=8,
                       D=128)
    hargs = head_inputs(b=8, K=7, H=512, r=128, V=5003, device="cuda", prime=True)

    def both():
        return (ops.draft_attention(*args),) + tuple(ops.sequential_head(*hargs))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        both()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = both()
    args[0].normal_()
    hargs[0].normal_()
    g.replay()
    eager = both()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(static, eager))
