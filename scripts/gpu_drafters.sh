#!/usr/bin/env bash
# Train the shipped tiny drafter and its ablations at once on one borrowed GPU (bounded run).
#
#   bash scripts/gpu_drafters.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu_out
#
# Same recipe and data as scripts/train_drafter_tiny.sh (configs/dlite-tiny.yaml), with the
# target's features computed online on the GPU instead of written to files. Needs the sequences
# regenerated beforehand on a machine with vLLM:
#   .venv/bin/python -m vllm_dlite.train --config configs/dlite-tiny.yaml --only-data
# Runs in parallel (a tiny model leaves the GPU mostly idle): the recipe (two-stage), stable-only,
# feature-wise features, and a second head rank; each is stopped after GPU_RUN_SECONDS (245). Each run's drafter, training_report.json and
# metrics.jsonl come back as one tar (split into < 16 MB parts). Extra arguments go to every run.
set -u
OUT_DIR=${1:-${OUT:-gpu_out}}; shift || true
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
SEQ=runs/dlite-qwen3-tiny-stdlib/data/sequences.jsonl
COMMON=(--config configs/dlite-tiny.yaml --sequences "$SEQ" --set data.feature_source=online
        --set run.threads=3 --set run.tensorboard=false "$@")
declare -A RUNS=(
  [recipe]=""
  [stable_only]="--ablation stable_only"
  [feature_wise]="--ablation feature_mode=feature"
  [rank64]="--ablation head_rank=64"
)
for name in "${!RUNS[@]}"; do
  # shellcheck disable=SC2086
  timeout "${GPU_RUN_SECONDS:-245}" python3 -m vllm_dlite.train "${COMMON[@]}" ${RUNS[$name]} --out "runs/gpu/$name/drafter" \
      --work-dir "runs/gpu/$name/work" > "$OUT_DIR/$name.log" 2>&1 &
done
wait
echo "all runs done after $(( $(date +%s) - START )) s"
for name in "${!RUNS[@]}"; do
  echo "== $name"; grep -E "tau|stage .*epochs|error|Error" "$OUT_DIR/$name.log" | tail -n 8
  mkdir -p "runs/gpu/$name/drafter" && cp "runs/gpu/$name/work/metrics.jsonl" "runs/gpu/$name/drafter/" 2>/dev/null
done
tar -cf /tmp/drafters.tar runs/gpu/*/drafter
split -b 15M /tmp/drafters.tar "$OUT_DIR/drafters.tar.part-"
ls -l "$OUT_DIR"; echo "total $(( $(date +%s) - START )) s"
