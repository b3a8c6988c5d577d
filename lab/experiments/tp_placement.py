#!/usr/bin/env python3
"""Where the DLite drafter's weights live under tensor parallelism: memory and time per rank at
Qwen3-8B shapes, CALCULATED (no GPU needed; the bandwidth is the one measured on an H200).

    .venv/bin/python lab/experiments/tp_placement.py [--tp 1 2 4 8] [--collective-us 10] [--json F]

Terms:
* ``drafter``: the dlite_v1 checkpoint's own weights (context norm, depth embedding, backbone
  layers, sequential head with its own ``[V, r]`` embedding and output projection), counted from a
  meta-device ``DLiteDrafter`` with the paper's Qwen3-8B sizes (5 layers of width 4096, 32/8 heads
  of 128, SwiGLU 12288, 14 feature layers, head rank 512, B 8 = K 7 + the anchor).
* ``shared``: the target's ``embed_tokens`` ``[151,936, 4,096]`` (dlite_v1 never reads the
  target's lm_head); vLLM shards it over the vocabulary (``VocabParallelEmbedding``).
* ``extra GB/rank``: memory each rank spends on DLite beyond what the target already holds (it
  comes out of that rank's KV pool; ``KV tokens lost`` divides by Qwen3-8B's KV bytes per token
  per rank: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes / TP).
* ``head ms``: one round's sequential head = K reads of its own ``[V, r]`` output projection at
  batch 1, at the bandwidth the earlier fused head op achieved on the H200
  (``benchmarks/results/gpu_kernels_h200.json``, CUDA graph, batch 1).
  ``backbone ms``: one read of the backbone weights at the same bandwidth.
* ``collectives``: per round; each costs ``--collective-us`` (an ASSUMED small-message latency,
  not measured here).

Placements:
* ``replicate`` (what vllm-dlite does): every rank holds the whole drafter and a full copy of the
  shared matrices (all-gathered once at load); drafting needs no collective and runs the fused
  head op over the whole vocabulary.
* ``shard-vocab``: the head's ``[V, r]`` tables and the embedding sharded over the vocabulary: per
  step a distributed argmax (all-reduce) and an embedding lookup (all-reduce), 2K collectives per
  round.
* ``shard-all``: also the backbone's linear layers tensor-parallel (2 all-reduces per layer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

QWEN3_8B = dict(hidden=4096, vocab=151_936, layers=36, kv_heads=8, head_dim=128, tied=False)
DRAFTER_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  intermediate_size=12288, num_hidden_layers=5, block_size=8, sequential_rank=512)
BYTES = 2  # bf16


def drafter_parameters() -> int:
    import torch

    from vllm_dlite.config import DLiteConfig, build_target_layer_ids
    from vllm_dlite.model import DLiteDrafter

    cfg = DLiteConfig(target_layer_ids=build_target_layer_ids(QWEN3_8B["layers"], 14), **DRAFTER_8B,
                      mask_token_id=0, vocab_size=QWEN3_8B["vocab"], num_target_layers=QWEN3_8B["layers"])
    with torch.device("meta"):
        model = DLiteDrafter(cfg)
    return sum(p.numel() for p in model.parameters())


def measured_head_bandwidth() -> float:
    """Bytes/s the fused sequential head achieved on the H200 at batch 1 (CUDA graph)."""
    data = json.loads((REPO / "benchmarks/results/gpu_kernels_h200.json").read_text())
    row = next(t for t in data["timings"] if t["op"] == "sequential_head" and t["batch"] == 1 and t["mode"] == "graph")
    return row["op_tbps"] * 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--collective-us", type=float, default=10.0, help="assumed latency of one small all-reduce")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    K = DRAFTER_8B["block_size"] - 1
    H, V = QWEN3_8B["hidden"], QWEN3_8B["vocab"]
    matrix = V * DRAFTER_8B["sequential_rank"] * BYTES  # the head's output projection, read per step
    shared = V * H * BYTES  # the target's embed_tokens
    drafter = drafter_parameters() * BYTES
    bw = measured_head_bandwidth()
    kv_per_token = QWEN3_8B["layers"] * QWEN3_8B["kv_heads"] * QWEN3_8B["head_dim"] * 2 * BYTES
    coll = args.collective_us / 1000
    print(f"Qwen3-8B: embed_tokens {shared / 1e9:.3f} GB (bf16); "
          f"DLite drafter {drafter / 1e9:.3f} GB ({drafter // BYTES:,} parameters); head bandwidth "
          f"{bw / 1e12:.2f} TB/s (measured, H200); collective {args.collective_us:g} us (assumed)")
    rows = []
    for tp in args.tp:
        head_full = K * matrix / bw * 1000
        backbone = drafter / bw * 1000
        layers = DRAFTER_8B["num_hidden_layers"]
        options = {
            "replicate": dict(extra=drafter + shared * (1 - 1 / tp), head=head_full, backbone=backbone, collectives=0),
            "shard-vocab": dict(extra=drafter - 2 * matrix * (1 - 1 / tp), head=head_full / tp, backbone=backbone,
                                collectives=2 * K if tp > 1 else 0),
            "shard-all": dict(extra=drafter / tp, head=head_full / tp, backbone=backbone / tp,
                              collectives=(2 * K + 2 * layers) if tp > 1 else 0),
        }
        for name, o in options.items():
            ms = o["head"] + o["backbone"] + o["collectives"] * coll
            rows.append(dict(tp=tp, placement=name, extra_gb_per_rank=o["extra"] / 1e9,
                             kv_tokens_lost_per_rank=int(o["extra"] / (kv_per_token / tp)),
                             head_ms=o["head"], backbone_ms=o["backbone"], collectives=o["collectives"],
                             round_ms=ms))
    print("\n| TP | placement | extra GB/rank | KV tokens lost | head ms | backbone ms | collectives | round ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tp']} | {r['placement']} | {r['extra_gb_per_rank']:.2f} | {r['kv_tokens_lost_per_rank']:,} | "
              f"{r['head_ms']:.2f} | {r['backbone_ms']:.2f} | {r['collectives']} | {r['round_ms']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(dict(shapes=dict(QWEN3_8B, **DRAFTER_8B), head_bandwidth_Bps=bw,
                                             collective_us_assumed=args.collective_us, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
