#!/usr/bin/env bash
# EAGLE-3, DFlash and DLite on the SAME data at a stated compute budget each, for one target:
#   TARGET=runs/target-docstring2/model NAME=qwen3-tiny-stdlib bash scripts/train_drafters_same_data.sh
# 1. One regeneration by TARGET (vLLM, greedy): configs/dlite-tiny.yaml's training-split sessions
#    (agentic 24 x 8 turns, code 200, chat 300) plus DOCSTRINGS whole-file docstring questions
#    (`code:docstring`, long prompts whose reply is not in them), prompts WHOLE (data.max_len 32768),
#    to $WORK/data/sequences.jsonl. All three drafters read exactly these sequences.
# 2. DLite: the recipe of configs/dlite-tiny.yaml (teacher -> kl -> stable) from scratch on that file,
#    DLITE_EPOCHS="teacher kl stable" epochs.
# 3. EAGLE-3 and DFlash: scripts/train_baselines_tiny.sh on that file with MAX_LEN=32768 (no cap),
#    EAGLE3_EPOCHS / DFLASH_EPOCHS epochs.
# Compute: one CPU thread each, epochs chosen so each method's training takes about the same wall
# seconds; the seconds each one took are in $WORK/models/*/training_report.json (DLite: wall_s) and
# README.md (baselines: "training ...s"). Drafters go to $WORK/models/{dlite,eagle3,dflash}-$NAME,
# not models/: they replace the shipped ones only when the A/B says they are better.
# Resumable: re-run the same command (regeneration by chunk, DLite by checkpoint, speculators by
# epoch). PARALLEL=1 trains the three methods at once (three processes, one thread each).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=${TARGET:?set TARGET to the target directory}
NAME=${NAME:-$(basename "$TARGET")}
WORK=${WORK:-runs/same-data-$NAME}
DOCSTRINGS=${DOCSTRINGS:-100}
read -r TEACHER KL STABLE <<< "${DLITE_EPOCHS:-10 4 8}"
EAGLE3_EPOCHS=${EAGLE3_EPOCHS:-1}
DFLASH_EPOCHS=${DFLASH_EPOCHS:-6}
DATA=$WORK/data/sequences.jsonl
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

if [ ! -f "$TARGET/model.safetensors" ]; then
  echo "error: $TARGET/model.safetensors is missing: set TARGET to a trained target directory" >&2
  exit 1
fi
SAME=(--config configs/dlite-tiny.yaml --target "$TARGET" --sequences "$DATA"
      --set data.max_len=32768 --set "data.regenerate.kinds.code:docstring=$DOCSTRINGS"
      --set data.regenerate.chunk_size=64)  # progress saved every 64 requests
"$PY" -m vllm_dlite.train "${SAME[@]}" --only-data

dlite() {
  "$PY" -m vllm_dlite.train "${SAME[@]}" --work-dir "$WORK/dlite" --out "$WORK/models/dlite-$NAME" \
    --set epochs.teacher="$TEACHER" --set epochs.kl="$KL" --set epochs.stable="$STABLE" \
    --set run.stage_time_budget_s={} > "$WORK/dlite.log" 2>&1
}
baseline() {  # $1 = method ("features": the shared store only), $2 = epochs
  TARGET=$TARGET NAME=$NAME DATA=$DATA WORK=$WORK/baselines MAX_LEN=32768 OUT_DIR=$WORK/models \
    METHODS=${1/features/} EPOCHS=$2 bash scripts/train_baselines_tiny.sh > "$WORK/$1.log" 2>&1
}
mkdir -p "$WORK/models"
baseline features 0  # the baselines' shared feature store, written once before they train
if [ "${PARALLEL:-0}" = 1 ]; then
  dlite & a=$!; baseline eagle3 "$EAGLE3_EPOCHS" & b=$!; baseline dflash "$DFLASH_EPOCHS" & c=$!
  wait $a && wait $b && wait $c
else
  dlite; baseline eagle3 "$EAGLE3_EPOCHS"; baseline dflash "$DFLASH_EPOCHS"
fi
ls "$WORK/models"
