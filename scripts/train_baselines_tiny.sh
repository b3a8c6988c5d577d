#!/usr/bin/env bash
# Baseline drafters for the A/B benchmark, trained with speculators==0.9.0 on the SAME on-policy
# data as DLite (K = 7, sized by DESIGN.md section 1):
#   models/qwen3-tiny-stdlib -> models/eagle3-qwen3-tiny-stdlib   (1 layer, target ids 2 6 11)
#                            -> models/dflash-qwen3-tiny-stdlib   (2 layers, ids 1 3 5 8 10 12, block 8)
#                            -> models/dspark-qwen3-tiny-stdlib   (2 layers, same ids, block 7, Markov rank 64;
#                                                                  vLLM 0.32 serves DSpark on GPU / Model Runner V2 only)
# Layer ids are vLLM aux ids (residual stream after i decoder layers, pre-norm).
# Data: the regenerated sequences of scripts/train_drafter_tiny.sh (regenerated here with the same
# settings when missing). Target features are written ONCE (bf16, layers 1..12, ~6 KB/token) to
# runs/baselines/features-qwen3-tiny-stdlib and shared by the three methods; speculators
# checkpoints go to runs/baselines/<model name>/checkpoints, and re-running resumes them.
# Shipped weights (the A/B baselines): EAGLE-3 and DFlash, 1 epoch each (236 speculators steps of
# 4,096 packed tokens over the 839 sequences / 737,387 tokens), speculators' defaults otherwise:
# Muon + AdamW at lr 1e-3 with linear decay, EAGLE-3 --ttt-steps 3, DFlash --max-anchors 512. That is
# what fitted on the 2-core CPU then (EAGLE-3 ~15 s/step with 3 TTT steps, ~32 s with 7; DFlash
# ~5-8 s/step). Since the tile-sparse attention and heap reuse of
# vllm_dlite/train/baselines/patches.py (one thread, CPU seconds a step, median of steps 2-7):
# EAGLE-3 3.9 s with 3 TTT steps, 9.2 s with 7 (was 30.6 s); DFlash 1.55 s (was 4.8 s), i.e.
# ~15 / ~36 / ~6 min an epoch of 236 steps on one core.
# DLite's shipped drafter had 6 stable epochs on a GPU, see README "A/B" for the budget comparison.
# Overrides: EPOCHS=... METHODS="eagle3 dflash dspark" DATA=... EAGLE3_ARGS="--ttt-steps 7" \
#   REUSE=runs/dlite-qwen3-tiny-stdlib/data/features/hidden_states (DLite's feature files, same data)
#   bash scripts/train_baselines_tiny.sh [extra flags for every method]
# CPU: set OMP_NUM_THREADS=1 and run one METHODS value per process to train two methods at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-models/qwen3-tiny-stdlib}
DATA=${DATA:-runs/dlite-qwen3-tiny-stdlib/data/sequences.jsonl}
WORK=${WORK:-runs/baselines}
EPOCHS=${EPOCHS:-1}
METHODS=${METHODS:-eagle3 dflash}
EAGLE3_ARGS=${EAGLE3_ARGS:---ttt-steps 3}
REUSE=${REUSE:-}
NAME=$(basename "$TARGET")
FEATURES=$WORK/features-$NAME
export TOKENIZERS_PARALLELISM=false

if [ ! -f "$TARGET/model.safetensors" ]; then
  echo "error: $TARGET/model.safetensors is missing; train the target first (make target)" >&2
  exit 1
fi

# 1. on-policy data: DLite's own file, regenerated from configs/dlite-tiny.yaml when missing (one
#    recipe, so the baselines and DLite always train on the same sequences)
if [ ! -f "$DATA.meta.json" ]; then
  "$PY" -m vllm_dlite.train --config configs/dlite-tiny.yaml --sequences "$DATA" --only-data
fi

# 2. target features once (resumable), 3. train + export each baseline
STORE=(--target "$TARGET" --data "$DATA" --work-dir "$WORK" --features "$FEATURES" --max-len 4096)
if [ -n "$REUSE" ]; then STORE+=(--reuse-features "$REUSE"); fi
"$PY" -m vllm_dlite.train.baselines --method dflash --out "models/dflash-$NAME" "${STORE[@]}" \
  --features-only
for METHOD in $METHODS; do
  EXTRA=()
  if [ "$METHOD" = eagle3 ] && [ -n "$EAGLE3_ARGS" ]; then read -r -a EXTRA <<< "$EAGLE3_ARGS"; fi
  "$PY" -m vllm_dlite.train.baselines --method "$METHOD" --out "models/$METHOD-$NAME" \
    "${STORE[@]}" --epochs "$EPOCHS" "${EXTRA[@]}" "$@"
done
