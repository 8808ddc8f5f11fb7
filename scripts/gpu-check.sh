#!/usr/bin/env bash
# The GPU check, run on a machine with one CUDA GPU and no network (scripts/gpu-prepare.sh
# first, on a machine with network: it fills .gpu/, which the device call carries):
#   1. installs the carried wheels (.gpu/whl) and our package into a private folder
#   2. records the machine (nvidia-smi, torch, CUDA):             $OUT/env.txt
#   3. draws a random SmolLM2-shaped model (.gpu/model's config and tokenizer)
#   4. runs the CUDA-marked tests (tests/cuda):                   $OUT/cuda-tests.txt
#   5. bench engine on CUDA, bfloat16: TTFT recomputed / from L1 / L2 / L3 of a
#      2,048-token prompt, and L1<->L2 copy GB/s against torch's pinned copies:
#                                                                 $OUT/engine.json
#   6. checks the issue's bars (all CUDA tests pass; TTFT from L2 <= 1/20 of the
#      recompute; L1<->L2 copies >= 0.8x torch's pinned copy):    $OUT/summary.json
# Each step has its own time limit; together they stay under 8 minutes (470 s).
# --dry-run: the same steps on the CPU with a 2-layer model and tiny sizes; the CUDA
# tests are collected and skipped (tests/cuda/test_gpu_check.py runs it).
# Environment: OUT (default .gpu/out), GPU_CHECK_DIR (default .gpu), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--dry-run]" >&2
  exit 2
fi
PY=${PYTHON:-python3}
GPU_DIR=${GPU_CHECK_DIR:-$ROOT/.gpu}
OUT=${OUT:-$GPU_DIR/out}
mkdir -p "$OUT"
export ROOT PY GPU_DIR OUT
LOG=$OUT/log.txt
: >"$LOG"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
export WORK
trap 'rm -rf "$WORK"' EXIT
failed=()

step() { # step NAME SECONDS COMMAND...: run with a time limit, log it, remember a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%T), limit ${limit}s)" | tee -a "$LOG"
  if declare -F "$1" >/dev/null; then # a function of this script: in a bash of its own
    export -f "${1?}"
    timeout "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee -a "$LOG"
  else
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  fi
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { failed+=("$name (exit $rc)"); echo "== $name failed: exit $rc" | tee -a "$LOG"; }
  return "$rc"
}

install() {
  local wheels=("$GPU_DIR"/whl/*.whl)
  if [ -e "${wheels[0]}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$WORK/site" "${wheels[@]}" || return
  fi
  # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
  mkdir -p "$WORK/src" && cp -r "$ROOT/asynchicache" "$ROOT/pyproject.toml" "$ROOT/README.md" \
    "$WORK/src/" || return
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --target "$WORK/site" "$WORK/src"
}

machine() {
  { command -v nvidia-smi >/dev/null && nvidia-smi; lscpu | grep -E "Model name|^CPU\(s\)"; uptime
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

step install 45 install || exit 1
export PYTHONPATH="$ROOT:$WORK/site"
step machine 30 machine
MODEL=$WORK/model
if [ "$DRY" -eq 1 ]; then
  step model 40 "$PY" tests/cuda/random_model.py "$GPU_DIR/model" "$MODEL" --layers 2
  bench=(--device cpu --dtype float32 --prompt-tokens 64 --decode-tokens 4 --batch 2
    --repeats 1 --threads 1 --copy-pages 8 --skip-hf)
else
  step model 40 "$PY" tests/cuda/random_model.py "$GPU_DIR/model" "$MODEL"
  bench=(--device cuda --dtype bfloat16 --prompt-tokens 2048 --repeats 2 --copy-pages 512)
fi
export ASYNCHICACHE_CUDA_MODEL=$MODEL # the model tests/cuda run
step cuda-tests 180 "$PY" -m pytest -q -rs -m cuda \
  -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" tests/cuda
cp "$LOG" "$OUT/cuda-tests.txt"
step bench-engine 165 "$PY" -m asynchicache bench engine --model "$MODEL" "${bench[@]}" \
  --json --out "$OUT"
step summary 10 "$PY" - "$OUT" "$DRY" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
suite = ET.parse(out / "cuda-tests.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
engine = json.loads((out / "engine.json").read_text())
l2 = engine["ttft_l2_s"] / engine["ttft_recompute_s"]
copies = min(engine["l1_to_l2_vs_torch"], engine["l2_to_l1_vs_torch"])
bars = {
    "all_cuda_tests_pass": tests["failures"] == tests["errors"] == 0
    and (dry or tests["skipped"] == 0),
    "ttft_l2_le_recompute_over_20": l2 <= 1 / 20,
    "l1_l2_copy_ge_0.8x_torch": copies >= 0.8,
}
summary = {"dry_run": dry, "tests": tests, "ttft_l2_over_recompute": round(l2, 4),
           "copy_vs_torch": copies, "bars": bars, "device": engine.get("device")}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
if [ ${#failed[@]} -gt 0 ]; then
  printf 'gpu-check: failed steps: %s\n' "${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "gpu-check: every step ran; the bars: $OUT/summary.json" | tee -a "$LOG"
