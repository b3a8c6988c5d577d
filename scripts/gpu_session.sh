#!/usr/bin/env bash
# Everything this project does on a borrowed GPU machine, as one bounded run (< 9.5 minutes).
#
#   bash scripts/gpu_session.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu_out
#
# 1. csrc/ kernels: JIT build, correctness against the PyTorch reference, timings at Qwen3-8B
#    shapes (benchmarks/gpu_kernels.py; writes gpu_kernels.{json,md}).
# 2. the tiny target recipe on the GPU in the time that is left: pre-training, SFT, then whole
#    agent sessions up to 30k tokens, each with a wall-clock budget (lab.target.train /
#    .sft / .long --device cuda --time-budget-s), starting from the cached tokenized corpus in
#    data/ (made on the CPU by the same recipe). GPU_SESSION_KERNELS=0 skips step 1.
#    The result comes back as target.tar (split into < 16 MB parts).
# Needs the machine's own python3 with torch + transformers; vLLM is not required.
set -u
OUT_DIR=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$((START + ${GPU_SESSION_SECONDS:-550}))
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "== kernels"
[ "${GPU_SESSION_KERNELS:-1}" = 0 ] || timeout 280 python3 benchmarks/gpu_kernels.py --out "$OUT_DIR" > "$OUT_DIR/kernels.log" 2>&1
echo "kernels rc $? after $(( $(date +%s) - START )) s"; tail -n 40 "$OUT_DIR/kernels.log"

echo "== target"
left=$((DEADLINE - $(date +%s) - 60))  # 60 s: two model loads, held-out loss, saving, packing
if [ "$left" -lt 60 ]; then echo "no time left for the target ($left s)"; exit 0; fi
pre=$((left * 50 / 100)); sft=$((left * 25 / 100 - 10)); long=$((left * 25 / 100 - 30))
TGT=/tmp/qwen3-tiny-stdlib
rm -rf "$TGT"; mkdir -p "$TGT"
cp models/qwen3-tiny-stdlib/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$TGT"/
python3 -m lab.target.train --out "$TGT" --device cuda --time-budget-s "$pre" \
    --seq-len 1024 --batch-size 32 --lr 1.5e-3 > "$OUT_DIR/target.log" 2>&1
echo "pretrain rc $? after $(( $(date +%s) - START )) s"
python3 -m lab.target.sft --target "$TGT" --device cuda --time-budget-s "$sft" \
    --batch-size 32 --window 1024 >> "$OUT_DIR/target.log" 2>&1
echo "sft rc $? after $(( $(date +%s) - START )) s"
python3 -m lab.target.long --target "$TGT" --device cuda --time-budget-s "$long" \
    --state /tmp/target-long-state.pt >> "$OUT_DIR/target.log" 2>&1
echo "long rc $? after $(( $(date +%s) - START )) s"
grep -E "^\[(corpus|model)\]|heldout|step [0-9]*0 " "$OUT_DIR/target.log" | tail -n 30
tar -C /tmp -cf /tmp/target.tar qwen3-tiny-stdlib
split -b 15M /tmp/target.tar "$OUT_DIR/target.tar.part-"
ls -l "$OUT_DIR"; echo "total $(( $(date +%s) - START )) s"
