#!/usr/bin/env bash
# The long fault run: the fault matrix at full scale (20+ cache-service kills, 60
# corrupted files, more prompts and longer phases), the chaos test at full size (40
# SIGSTOPs of the cache service and 40 of redis-server, 1-3 s each), a longer
# short-soak, and more fuzzing examples; then the fault matrix as a table (also left
# in $OUT), and `cache verify --deep` of the folder the chaos test leaves in
# $OUT/chaos-kv.
#
#   scripts/faults-full.sh                      # everything, full scale
#   FAULTS_SERVICE_KILLS=40 scripts/faults-full.sh tests/faults/test_fault_matrix.py
#
# Every knob of tests/faults/fault_helpers.py can be overridden as FAULTS_<NAME>
# (service_kills, kill_gap_s, corruptions, prompts, clients, heavy_prompts,
# disk_full_prompts, redis_prompts, phase_s, chaos_pauses, chaos_pause_max_ms,
# chaos_prompts, chaos_restart, chaos_sample); FUZZ_EXAMPLES and FUZZ_HTTP_EXAMPLES
# size the fuzzing, SOAK_SECONDS the soak.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-${TMPDIR:-/tmp}/asynchicache-faults}
mkdir -p "$OUT"
export FAULTS_SCALE=full
export FAULTS_REPORT="$OUT/faults.jsonl"
export FAULTS_KEEP_DIR="$OUT"
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
chaos = [r for r in rows if "deep_verify" in r["notes"]]
if chaos:
    print()
    print("| chaos run | pauses injected | requests | failed | wrong | tickets late "
          "| slots quarantined | pages deep-verified | mismatched | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in chaos:
    n, audit = r["notes"], r["notes"]["deep_verify"]
    print(f"| {r['scenario']} | {r['faults_injected']} | {r['requests_served']} "
          f"| {r['requests_failed']} | {r['wrong_outputs']} | {n['tickets_late']} "
          f"| {n['slots_quarantined']} | {audit['checked']} | {audit['mismatched']} "
          f"| {audit['max_abs_diff']} |")
EOF

if [ -d "$OUT/chaos-kv" ]; then
  echo "cache verify --deep $OUT/chaos-kv (the folder the chaos test left):"
  .venv/bin/python -m asynchicache cache verify --deep --keep --disk-cache-dir "$OUT/chaos-kv" \
    | tee "$OUT/chaos-deep-verify.txt" || status=$?
fi
exit "$status"
