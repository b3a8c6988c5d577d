#!/usr/bin/env python3
"""Qwen3-8B-shape target steps against draft rounds, plain torch (no vLLM), CUDA graphs: stage d of
``benchmarks/gpu_check.py`` (which runs :func:`measure` in its own process, with a time limit).

    python benchmarks/gpu_shapes.py --out /tmp/shapes              # alone; tiny shapes on CPU

Random weights, bf16 on CUDA, each step captured in a CUDA graph and replayed (timed with
``gpu_kernels.time_ms``, the one timing helper of the GPU benchmarks): the target's decode step
(1 token) and verify step (K+1 = 8 tokens): 36 Qwen3 decoder layers (RMSNorm, QKV, q/k norm, RoPE,
KV-cache append, SDPA with GQA over the cache, O, SwiGLU MLP) + final norm + lm_head over every new
row, at batch 1-64 and context 1k-32k; the KV caches of the 36 layers rotate over as many distinct
buffers as fit in ``kv_gib`` (never fewer than needed to stay out of L2). Against: the dlite_v1
draft round (``DLiteDrafter``: 5 layers, r 512, 14 features ``build_target_layer_ids(36, 14)``,
K = 7, greedy; history-free, so one number per batch), and approximations of an EAGLE-3 round
(7 x [one decoder layer, 1 token over the context + lm_head over a 32k draft vocabulary]) and a
DFlash round (5 decoder layers over K+1 = 8 tokens attending to the context + lm_head over K rows,
151,936 vocabulary). Ratios draft / verify. On CPU: tiny shapes, wall time (for tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_kernels, beside this file

from gpu_kernels import time_ms  # noqa: E402  (also puts the repository on sys.path)


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




TINY = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, draft_layers=1,
            rank=64, features=3, eagle_vocab=128, dflash_layers=1)  # the CPU stand-in for Qwen3-8B


def free_gpu() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(rec: dict, save: Callable[[], None] = lambda: None, *, batches=(1, 8, 32, 64),
            contexts=(1024, 4096, 16384, 32768), iters: int = 10, kv_gib: float = 40.0, budget_s: float = 60,
            shapes: Optional[Qwen3Shapes] = None) -> bool:
    """Fill ``rec`` (``what``, ``rows`` per batch x context, ``dlite_round_ms`` per batch, ``dlite_backend``,
    ``skipped``), calling ``save()`` after each row; True when some row was measured and none failed.
    No new row starts after ``budget_s``. On CPU: tiny shapes (:data:`TINY`), contexts capped at 64."""
    import torch

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    s = shapes or (Qwen3Shapes() if on_gpu else Qwen3Shapes(**TINY))
    contexts = list(contexts) if on_gpu else sorted({min(c, 64) for c in contexts})
    K = s.k
    rec["what"] = ("target step = %d Qwen3 layers (H %d, %d/%d heads x %d, MLP %d) with KV cache + SDPA, final "
                   "norm, lm_head %d over the new rows; decode = 1 new token, verify = K+1 = %d; dlite = "
                   "DLiteDrafter.draft (%d layers, r %d, %d features, K %d, greedy); eagle3 ~ %d x (1 layer, 1 "
                   "token over the context, lm_head %d); dflash ~ %d layers over K+1 tokens + lm_head %d over K "
                   "rows; %s; %s" % (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab,
                                     K + 1, s.draft_layers, s.rank, s.features, K, K, s.eagle_vocab,
                                     s.dflash_layers, s.vocab, str(dtype).replace("torch.", ""),
                                     "CUDA-graph replays, median" if on_gpu else "CPU wall, median"))
    deadline = time.time() + budget_s
    t0 = time.perf_counter()
    target = TorchStack(s, s.layers, s.vocab, device, dtype, seed=0)
    eagle = TorchStack(s, 1, s.eagle_vocab, device, dtype, seed=1)
    dflash = TorchStack(s, s.dflash_layers, s.vocab, device, dtype, seed=2)
    drafter = build_dlite(s, target, device, dtype)
    from vllm_dlite.ops import dispatch

    if on_gpu:  # the CUDA ops of csrc/ (JIT-built unless installed); the reference if that fails
        import tempfile

        from gpu_kernels import build
        try:
            rec["dlite_build"] = build("auto", Path(tempfile.gettempdir()) / "dlite_jit_build")
        except Exception as exc:  # noqa: BLE001
            rec["dlite_build"] = f"failed, PyTorch reference used: {exc!r:.300}"

    rec["setup_s"] = round(time.perf_counter() - t0, 1)
    rows, dlite_ms = rec.setdefault("rows", []), rec.setdefault("dlite_round_ms", {})
    g = torch.Generator(device=device).manual_seed(0)
    for b in batches:
        if time.time() > deadline:
            rec.setdefault("skipped", []).append(f"batch {b}: out of time")
            continue
        feats = torch.randn(b, s.features, s.hidden, generator=g, device=device, dtype=dtype)
        ids = torch.randint(0, s.vocab - 1, (b, 1), generator=g, device=device)
        ms, how = time_ms(lambda: drafter.draft(feats, ids, temperature=0.0, k=K), device, iters, graph=True)
        dlite_ms[b] = dict(ms=round(ms, 3), how=how)
        rec["dlite_backend"] = dispatch.backend_report()
        for ctx in contexts:
            if time.time() > deadline:
                rec.setdefault("skipped", []).append(f"batch {b} context {ctx}: out of time")
                continue
            T = ctx + K + 1
            per_layer = 2 * b * s.kv_heads * T * s.head_dim * (2 if on_gpu else 4)
            m = int(min(s.layers, max(1, kv_gib * 2 ** 30 // per_layer)))
            row = dict(batch=b, context=ctx, kv_buffers=m, kv_gib_per_layer=round(per_layer / 2 ** 30, 3))
            try:
                caches = [(torch.zeros(b, s.kv_heads, T, s.head_dim, device=device, dtype=dtype),
                           torch.zeros(b, s.kv_heads, T, s.head_dim, device=device, dtype=dtype)) for _ in range(m)]
                for name, stack, q, reps, logits_rows in (
                        ("decode", target, 1, 1, None), ("verify", target, K + 1, 1, None),
                        ("eagle3", eagle, 1, K, None), ("dflash", dflash, K + 1, 1, K)):
                    x = torch.randn(b, q, s.hidden, generator=g, device=device, dtype=dtype)
                    cos, sin = stack.rope_tables(torch.arange(ctx, ctx + q, device=device))

                    def fn(stack=stack, x=x, reps=reps, cos=cos, sin=sin, lr=logits_rows):
                        for _ in range(reps):
                            stack.step(x, caches, ctx, cos, sin, None, lr)

                    ms, how = time_ms(fn, device, iters, graph=True)
                    row[f"{name}_ms"] = round(ms, 3)
                    row["how"] = how
                row["dlite_ms"] = dlite_ms[b]["ms"]
                for name in ("dlite", "eagle3", "dflash"):
                    row[f"{name}_over_verify"] = round(row[f"{name}_ms"] / row["verify_ms"], 4)
            except Exception as exc:  # noqa: BLE001 - recorded in the row; the next one still runs
                row["error"] = f"{exc!r:.300}"
            finally:
                caches = None
                free_gpu()
            rows.append(row)
            print(f"  {row}", flush=True)
            save()
    return bool(rows) and not any("error" in r for r in rows)


def measure_options(batches: Optional[str] = None, contexts: Optional[str] = None, iters: Optional[int] = None,
                    kv_gib: Optional[float] = None, budget_s: Optional[float] = None) -> dict:
    """:func:`measure`'s keyword arguments from command-line values (comma-separated batches and
    contexts); a value left None keeps :func:`measure`'s default, the one place the defaults live."""
    given = dict(batches=batches and [int(b) for b in batches.split(",")],
                 contexts=contexts and [int(c) for c in contexts.split(",")],
                 iters=iters, kv_gib=kv_gib, budget_s=budget_s)
    return {k: v for k, v in given.items() if v is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", help="comma-separated (default: measure's, 1,8,32,64)")
    ap.add_argument("--contexts", help="comma-separated (default: measure's, 1024,4096,16384,32768)")
    ap.add_argument("--iters", type=int)
    ap.add_argument("--kv-gib", type=float)
    ap.add_argument("--budget-s", type=float)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rec: dict = {}

    def save():
        (args.out / "gpu_shapes.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")

    ok = measure(rec, save, **measure_options(args.batches, args.contexts, args.iters, args.kv_gib, args.budget_s))
    save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
