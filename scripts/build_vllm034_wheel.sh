#!/usr/bin/env bash
# Build vLLM 0.34.0's CPU wheel from its PyPI source archive (PyPI has no CPU wheel of 0.34), by the
# recipe of ../shared/wheels/README.md. Prints the wheel's path as its last line.
#
#   bash scripts/build_vllm034_wheel.sh <oneDNN source tree>      # ~2 h on 2 cores
#
# <oneDNN source tree>: oneDNN at tag v3.13 (github uxlfoundation/oneDNN), what 0.34's
# cmake/cpu_extension.cmake would download; passed to CMake as FETCHCONTENT_SOURCE_DIR_ONEDNN.
# VLLM_SDIST=<vllm-0.34.0.tar.gz> uses a source archive you have; else pip downloads it.
# STOP_AFTER=prepare stops before the compile (checks the inputs, the patch and the build env);
# STOP_AFTER=configure also runs vLLM's CMake configure step (oneDNN included) in build/vllm034/configure.
#
# What it does:
#   * a build virtualenv (build/vllm034-venv) with torch 2.14.0 and the sdist's
#     requirements/build/cpu.txt less its torch lines;
#   * one change to the source: its CMake refuses gcc < 12.3 for the x86 backend and Debian 12 has
#     12.2, which compiles oneDNN and the AVX2 / AVX-512 kernel libraries; the gate is lowered to 12.2;
#   * the AMX / AVX-512-bf16 variant (`_C`) is left out of setup.py's extensions: gcc 12.2 stops on it with an internal
#     compiler error (vLLM's csrc/cpu/sgl-kernels/flash_mla.cpp), which is why vLLM asks for 12.3
#     (scripts/setup_vllm034.sh makes `_C` the AVX-512 library on such CPUs);
#   * torch 2.14's CMake config insists on CUDA: it is pointed at the CUDA toolkit that PyPI's
#     nvidia-* wheels (pulled in by torch) provide, plus nvcc from nvidia-cuda-nvcc at the runtime's
#     version (torch's CMake refuses an nvcc newer than the headers, and a newer nvvm writes PTX the
#     older ptxas rejects), completed to a toolkit's layout (lib64, unversioned libraries) so that
#     CMake's FindCUDA and nvcc's own link step find cudart;
#   * VLLM_TARGET_DEVICE=cpu, --py-limited-api=cp38, cargo kept off PATH (the optional Rust front end
#     needs crates that cannot be fetched here).
set -euo pipefail
cd "$(dirname "$0")/.."
ONEDNN_SRC=$(realpath "${1:?usage: build_vllm034_wheel.sh <oneDNN v3.13 source tree>}")
[ -f "$ONEDNN_SRC/CMakeLists.txt" ] || { echo "error: $ONEDNN_SRC is not a oneDNN source tree" >&2; exit 2; }
WORK=$(realpath -m build/vllm034)
BVENV="$WORK/venv"
TORCH=2.14.0
mkdir -p "$WORK"
[ -x "$BVENV/bin/python" ] || python3 -m venv "$BVENV"
pip() { "$BVENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q "torch==$TORCH" cmake ninja packaging "setuptools>=77,<81" "setuptools-scm>=8" setuptools-rust \
  wheel jinja2 regex >&2
cuda_rt=$("$BVENV/bin/python" -c "from importlib.metadata import version; print(version('nvidia-cuda-runtime'))")
cuda_mm=${cuda_rt%.*}
pip install -q "nvidia-cuda-nvcc==$cuda_mm.*" "nvidia-cuda-crt==$cuda_mm.*" "nvidia-nvvm==$cuda_mm.*" >&2

sdist=${VLLM_SDIST:-}
if [ -z "$sdist" ]; then
  # pip prepares an sdist's metadata on download, which runs vLLM's setup.py (hence the build env
  # above); its version would carry a +cpu / +cuXXX suffix and pip would discard the archive as
  # "inconsistent", so the version is pinned through vLLM's own VLLM_VERSION_OVERRIDE
  VLLM_VERSION_OVERRIDE=0.34.0 VLLM_TARGET_DEVICE=cpu \
    pip download -q --no-deps --no-binary vllm --no-build-isolation "vllm==0.34.0" -d "$WORK" >&2
  sdist="$WORK/vllm-0.34.0.tar.gz"
fi
src="$WORK/vllm-0.34.0"
rm -rf "$src"
tar -xzf "$sdist" -C "$WORK"

# the gcc gate: one line of cmake/cpu_extension.cmake
gate="$src/cmake/cpu_extension.cmake"
grep -q "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3" "$gate" \
  || { echo "error: $gate has no gcc 12.3 gate to lower: not the 0.34.0 sources?" >&2; exit 2; }
sed -i 's/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.2/' "$gate"

# the ISA variants: AVX2 and AVX-512, not the AMX one (see above): setup.py asks CMake for each by name
"$BVENV/bin/python" - "$src/setup.py" <<'PYEDIT'
import sys
path = sys.argv[1]
text = open(path).read()
amx = '        ext_modules.append(CMakeExtension(name="vllm._C"))\n        ext_modules.append(CMakeExtension(name="vllm._C_AVX512"))'
if amx not in text:
    sys.exit(f"error: {path}: no x86 _C / _C_AVX512 extension list to change: not the 0.34.0 sources?")
open(path, "w").write(text.replace(amx, '        ext_modules.append(CMakeExtension(name="vllm._C_AVX512"))', 1))
PYEDIT

grep -v '^torch' "$src/requirements/build/cpu.txt" > "$WORK/build-requirements.txt"
pip install -q -r "$WORK/build-requirements.txt" "torch==$TORCH" >&2

site=$("$BVENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cuda="$site/nvidia/cu13"
[ -x "$cuda/bin/nvcc" ] || { echo "error: no nvcc at $cuda/bin (pip nvidia-cuda-nvcc)" >&2; exit 2; }
# a toolkit's layout: lib64, and libcudart.so (etc.) beside the wheels' libcudart.so.13
(cd "$cuda/lib" && for f in *.so.*; do [ -e "${f%%.so*}.so" ] || ln -s "$f" "${f%%.so*}.so"; done)
[ -e "$cuda/lib64" ] || ln -s lib "$cuda/lib64"
if [ "${STOP_AFTER:-}" = prepare ]; then
  echo "[build_vllm034_wheel] prepared $src (gate lowered, build env $BVENV, CUDA $cuda_rt at $cuda)" >&2
  echo "$src"
  exit 0
fi

export VLLM_VERSION_OVERRIDE=0.34.0+cpu VLLM_TARGET_DEVICE=cpu MAX_JOBS=${MAX_JOBS:-2} CMAKE_BUILD_TYPE=Release
export FETCHCONTENT_SOURCE_DIR_ONEDNN="$ONEDNN_SRC"
export CMAKE_ARGS="-DCUDA_TOOLKIT_ROOT_DIR=$cuda -DCMAKE_CUDA_COMPILER=$cuda/bin/nvcc"
PATH=$(echo "$PATH" | tr ':' '\n' | grep -v cargo | paste -sd:)
if [ "${STOP_AFTER:-}" = configure ]; then
  # the configure step setup.py's build_ext runs first, on its own
  rm -rf "$WORK/configure" && mkdir -p "$WORK/configure"
  # shellcheck disable=SC2086
  (cd "$WORK/configure" && PATH="$BVENV/bin:$PATH" cmake "$src" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DVLLM_TARGET_DEVICE=cpu -DVLLM_PYTHON_EXECUTABLE="$BVENV/bin/python" \
     -DFETCHCONTENT_BASE_DIR="$WORK/configure/.deps" $CMAKE_ARGS >&2)
  echo "[build_vllm034_wheel] configured $src in $WORK/configure" >&2
  echo "$src"
  exit 0
fi
(cd "$src" && PATH="$BVENV/bin:$PATH" "$BVENV/bin/python" setup.py bdist_wheel --py-limited-api=cp38 >&2)
ls "$src"/dist/vllm-0.34.0*.whl | tail -1
