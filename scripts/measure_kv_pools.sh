#!/usr/bin/env bash
# KV-pool sizes of the tiny target under each speculative method (CPU, 2 GiB KV space).
# EAGLE-3 and DFlash keep draft KV; DLite must not. A pool size does not depend on how well a
# drafter is trained, so the EAGLE-3/DFlash checkpoints here get 2 training steps on 8 sequences
# (their tau in this run means nothing). Reads vLLM's own group-aware "KV cache size" per engine.
#   bash scripts/measure_kv_pools.sh    -> runs/kv-pools/ab/results.{json,md} (KV pool tokens column)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
OUT=runs/kv-pools
DATA=runs/dlite-qwen3-tiny-stdlib/data/sequences.jsonl   # from: python -m vllm_dlite.train --config configs/dlite-tiny.yaml --only-data
for m in eagle3 dflash; do
  .venv/bin/python -m lab.baselines --method $m --target models/qwen3-tiny-stdlib \
    --data "$DATA" --out "$OUT/$m" --work-dir "$OUT/work" \
    --max-sequences 8 --epochs 1 --max-steps 2 --max-len 1024 --max-anchors 16 --fresh
done
VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/ab.py --workload benchmarks/workloads/heldout_code.jsonl \
  --methods none,dlite,eagle3,dflash --eagle3 "$OUT/eagle3" --dflash "$OUT/dflash" --out "$OUT/ab" \
  --max-requests 2 --max-tokens 8 --concurrency 1 --max-prompt-tokens 8192
