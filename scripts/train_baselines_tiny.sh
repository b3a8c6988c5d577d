#!/usr/bin/env bash
# Baseline drafters for the A/B benchmark, trained with speculators==0.9.0 on the SAME on-policy
# data as DLite (K = 7):
#   models/qwen3-tiny-stdlib -> models/eagle3-qwen3-tiny-stdlib   (1 layer, target ids 2 6 11)
#                            -> models/dflash-qwen3-tiny-stdlib   (2 layers, ids 1 3 5 8 10 12, block 8)
#                            -> models/dspark-qwen3-tiny-stdlib   (2 layers, same ids, block 7, Markov rank 64;
#                                                                  vLLM 0.32 serves DSpark on GPU / Model Runner V2 only)
# Layer ids are vLLM aux ids (residual stream after i decoder layers, pre-norm).
# Data: the regenerated sequences of scripts/train_drafter_tiny.sh (regenerated here with the same
# settings when missing). Target features are written ONCE (bf16, layers 1..12, ~6 KB/token) to
# runs/baselines/features-qwen3-tiny-stdlib and shared by the three methods; speculators
# checkpoints go to runs/baselines/<model name>/checkpoints, and re-running resumes them.
# Defaults = the equal-budget recipe of the A/B (benchmarks/results/README.md, "Equal budgets"): the
# SAME sequences and epoch cap as DLite (6 epochs, last epoch exported), EAGLE-3 with 7 TTT steps as
# it is served (K = 7), DFlash block 8 (--max-anchors 512); Muon + AdamW at lr 1e-3, linear decay.
# One CPU thread, tile-sparse attention and heap reuse of lab/baselines/patches.py:
# DFlash 1.6 s a step (2,318 s for 6 epochs of 236 steps), EAGLE-3 ~9.4 s (~3.7 h).
# A run longer than a session resumes from speculators' checkpoints: re-run the same command. They
# are saved at every epoch end (EAGLE-3: every quarter epoch, --checkpoint-freq 0.25); the save
# speculators makes on SIGINT/SIGTERM ("interrupted") is NOT resumed from. A copy committed under
# resume/<name>/ seeds a machine whose runs/ lacks one.
# Overrides: EPOCHS=... METHODS="eagle3 dflash dspark" DATA=... EAGLE3_ARGS="--ttt-steps 7" \
#   MAX_LEN=32768 (whole prompts) OUT_DIR=... (models/ by default) NAME=... (the target's basename) \
#   REUSE=runs/dlite-qwen3-tiny-stdlib/data/features/hidden_states (DLite's feature files, same data)
#   bash scripts/train_baselines_tiny.sh [extra flags for every method]
# CPU: set OMP_NUM_THREADS=1 and run one METHODS value per process to train two methods at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-models/qwen3-tiny-stdlib}
DATA=${DATA:-runs/dlite-qwen3-tiny-stdlib/data/sequences.jsonl}
WORK=${WORK:-runs/baselines}
EPOCHS=${EPOCHS:-6}
METHODS=${METHODS-eagle3 dflash}  # METHODS= (empty): write the feature store only
EAGLE3_ARGS=${EAGLE3_ARGS:---ttt-steps 7 --speculators-arg=--checkpoint-freq=0.25}
REUSE=${REUSE:-}
NAME=${NAME:-$(basename "$TARGET")}
MAX_LEN=${MAX_LEN:-4096}
OUT_DIR=${OUT_DIR:-models}
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
STORE=(--target "$TARGET" --data "$DATA" --work-dir "$WORK" --features "$FEATURES" --max-len "$MAX_LEN")
if [ -n "$REUSE" ]; then STORE+=(--reuse-features "$REUSE"); fi
"$PY" -m lab.baselines --method dflash --out "$OUT_DIR/dflash-$NAME" "${STORE[@]}" \
  --features-only
for METHOD in $METHODS; do
  if [ ! -d "$WORK/$METHOD-$NAME/checkpoints" ] && [ -d "resume/$METHOD-$NAME/checkpoints" ]; then
    mkdir -p "$WORK/$METHOD-$NAME" && cp -r "resume/$METHOD-$NAME/checkpoints" "$WORK/$METHOD-$NAME/"
  fi
  EXTRA=()
  if [ "$METHOD" = eagle3 ] && [ -n "$EAGLE3_ARGS" ]; then read -r -a EXTRA <<< "$EAGLE3_ARGS"; fi
  "$PY" -m lab.baselines --method "$METHOD" --out "$OUT_DIR/$METHOD-$NAME" \
    "${STORE[@]}" --epochs "$EPOCHS" "${EXTRA[@]}" "$@"
done
