#!/usr/bin/env bash
# vLLM's suffix decoding (speculative method "suffix", a baseline of benchmarks/ab.py) imports
# arctic-inference, which PyPI publishes only as a source archive. Its suffix-tree extension is plain
# C++ (nanobind, no CUDA), so it builds here; this builds it against the project's torch (no build
# isolation, so pip does not fetch another torch) and installs it into .venv without dependencies.
# Its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED is set, so nothing else changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV_PY:-.venv/bin/python}  # scripts/setup_vllm034.sh passes .venv-vllm034's
VERSION=${VERSION:-0.3.0}
if [ ! -x "$PY" ]; then
  echo "error: $PY is missing; run make setup first" >&2
  exit 1
fi
if "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  echo "arctic-inference (suffix decoding) is already installed"
  exit 0
fi
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
"$PY" -m pip install -q --no-warn-conflicts --target "$BUILD/deps" nanobind==2.9.2 cmake ninja grpcio-tools protobuf==5.29.6
PATH="$BUILD/deps/bin:$PATH" PYTHONPATH="$BUILD/deps" \
  "$PY" -m pip wheel -q --no-build-isolation --no-deps "arctic-inference==$VERSION" -w "$BUILD/wheel"
"$PY" -m pip install -q --no-deps "$BUILD"/wheel/arctic_inference-*.whl
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('suffix decoding ready')"
