#!/usr/bin/env bash
# The long fault run: the fault matrix at full scale (20+ cache-service kills, 60
# corrupted files, more prompts and longer phases), a longer short-soak, and more
# fuzzing examples; then the fault matrix as a table (also left in $OUT).
#
#   scripts/faults-full.sh                      # everything, full scale
#   FAULTS_SERVICE_KILLS=40 scripts/faults-full.sh tests/faults/test_fault_matrix.py
#
# Every knob of tests/faults/fault_helpers.py can be overridden as FAULTS_<NAME>
# (service_kills, kill_gap_s, corruptions, prompts, clients, heavy_prompts,
# disk_full_prompts, redis_prompts, phase_s); FUZZ_EXAMPLES and FUZZ_HTTP_EXAMPLES
# size the fuzzing, SOAK_SECONDS the soak.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-${TMPDIR:-/tmp}/asynchicache-faults}
mkdir -p "$OUT"
export FAULTS_SCALE=full
export FAULTS_REPORT="$OUT/faults.jsonl"
export FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-1000}
export FUZZ_HTTP_EXAMPLES=${FUZZ_HTTP_EXAMPLES:-200}
export SOAK_SECONDS=${SOAK_SECONDS:-150}
: >"$FAULTS_REPORT"

bash scripts/ensure-services.sh
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests/faults tests/fuzz tests/security)
status=0
.venv/bin/python -m pytest -q -s -p no:cacheprovider --timeout 3600 "${targets[@]}" 2>&1 \
  | tee "$OUT/pytest.log" || status=$?

.venv/bin/python - "$FAULTS_REPORT" <<'EOF' | tee "$OUT/faults.md"
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| scenario | faults injected | requests served | failed | wrong outputs "
      "| corrupt detected / served | seconds |")
print("|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    corrupt = "-" if r["corrupt_detected"] is None else (
        f"{r['corrupt_detected']} / {r['corrupt_served']}")
    print(f"| {r['scenario']} | {r['faults_injected']} | {r['requests_served']} "
          f"| {r['requests_failed']} | {r['wrong_outputs']} | {corrupt} | {r['seconds']:.0f} |")
EOF
exit "$status"
