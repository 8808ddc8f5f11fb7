#!/usr/bin/env bash
# Prepares, on a machine with network, what scripts/gpu-check.sh needs on a GPU machine
# that has none, in .gpu/ (git-ignored; the device call carries it: carry [".gpu"]):
#   .gpu/whl/    wheels of our dependencies that the GPU image lacks (its package list:
#                /work/.library/device/KINDS.md), for its CPython 3.12, manylinux x86-64,
#                at the versions of our own venv
#   .gpu/model/  SmolLM2's config and tokenizer (gpu-check.sh draws random weights of that
#                shape there: the embedded GGUF, ~98 MB, is over the 64 MiB a call carries)
# Usage: scripts/gpu-prepare.sh   (then: scripts/gpu-check.sh on the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
GPU_DIR=${GPU_CHECK_DIR:-.gpu}
MISSING=(gguf pyzmq setproctitle fastapi starlette pydantic pydantic-core annotated-types
  typing-inspection uvicorn redis hiredis blake3)

exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$GPU_DIR/" "$exclude" 2>/dev/null || echo "/$GPU_DIR/" >>"$exclude"
mkdir -p "$GPU_DIR/whl"
rm -f "$GPU_DIR"/whl/*.whl
for name in "${MISSING[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$GPU_DIR/whl" "$name==$version"
done

rm -rf "$GPU_DIR/model" "$GPU_DIR/export"
PYTHONPATH=$PWD "$PY" -m asynchicache model export-hf "$GPU_DIR/export" >/dev/null
mkdir -p "$GPU_DIR/model"
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$GPU_DIR/export/$f" ] && cp "$GPU_DIR/export/$f" "$GPU_DIR/model/"
done
rm -rf "$GPU_DIR/export"
du -sh "$GPU_DIR"
echo "ready: run scripts/gpu-check.sh on the GPU machine with $GPU_DIR carried"
