#!/usr/bin/env bash
# Train the shipped DLite drafter (format dlite_v1, B = 8: K = 7) for the tiny stdlib target:
#   models/qwen3-tiny-stdlib  ->  models/dlite-qwen3-tiny-stdlib
# Recipe: configs/dlite-tiny.yaml (on-policy data regenerated with vLLM, target features written
# once, the authors' two-stage recipe: swa_teacher -> stage 1 KL -> stage 2 CE + TV).
# Working files (data, features, checkpoints, metrics.jsonl) go to runs/dlite-qwen3-tiny-stdlib;
# re-running the script resumes from the latest checkpoint. Extra arguments are passed on, e.g.
#   bash scripts/train_drafter_tiny.sh --set optim.lr=5e-4
# Multi-process (gloo on CPU / nccl on GPU): NPROC=2 bash scripts/train_drafter_tiny.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=models/qwen3-tiny-stdlib
if [ ! -f "$TARGET/model.safetensors" ]; then
  echo "error: $TARGET/model.safetensors is missing; train the target first (make target)" >&2
  exit 1
fi
export TOKENIZERS_PARALLELISM=false
if [ "${NPROC:-1}" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m vllm_dlite.train --config configs/dlite-tiny.yaml "$@"
fi
exec "$PY" -m vllm_dlite.train --config configs/dlite-tiny.yaml "$@"
