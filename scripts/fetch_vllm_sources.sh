#!/usr/bin/env bash
# Fetch the Python sources of the vLLM releases the plugin targets, for the static compat test
# (tests/test_compat_sources.py). Downloads each release's wheel once (no dependencies), keeps only
# its vllm/**/*.py under .vllm-sources/<version>/ (git-ignored) and deletes the wheel. Idempotent:
# a version whose folder is complete is skipped.
#
#   bash scripts/fetch_vllm_sources.sh                 # 0.32.0 0.33.0 0.34.0
#   bash scripts/fetch_vllm_sources.sh 0.33.0          # one version
#   DLITE_VLLM_SOURCES=/some/dir bash scripts/...      # another cache folder
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${DLITE_VLLM_SOURCES:-.vllm-sources}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.32.0 0.33.0 0.34.0)

mkdir -p "$DEST"
for v in "${VERSIONS[@]}"; do
  if [ -f "$DEST/$v/.complete" ]; then
    echo "vllm $v: $DEST/$v (cached)"
    continue
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  start=$(date +%s)
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: "vllm==$v" -d "$tmp"
  wheel=$(ls "$tmp"/vllm-*.whl)
  rm -rf "$DEST/$v"
  "$PY" - "$wheel" "$DEST/$v" <<'EOF'
import sys, zipfile
from pathlib import Path
wheel, dest = sys.argv[1], Path(sys.argv[2])
n = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("vllm/") and name.endswith(".py"):
            z.extract(name, dest)
            n += 1
(dest / ".complete").write_text(f"{Path(wheel).name}\n{n} files\n")
print(f"{n} .py files", end=" ")
EOF
  echo "vllm $v: $(du -h "$wheel" | cut -f1) wheel -> $DEST/$v ($(du -sh "$DEST/$v" | cut -f1)) in $(( $(date +%s) - start )) s"
  rm -rf "$tmp"
  trap - EXIT
done
