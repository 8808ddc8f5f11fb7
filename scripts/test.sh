#!/usr/bin/env bash
# `make test`: the installs, ruff, then the whole suite as jobs that two workers take in
# turn (the machine has two cores; one pytest run leaves a core idle much of the time:
# servers starting, waits on signals).
#
# The vLLM venv's packages install beside the main venv's (two pips, ~1.5 min each: one
# core each); our package goes into it once the main install is done (both write
# asynchicache.egg-info). The jobs, longest first, so that the two workers end together:
# a worker takes the next job nobody took. The type checker, tests/vllm (under .venv-vllm,
# ~8 min in one run: its servers are shared by its modules), and the main suite in parts
# (each part a pytest run of its own: ~10 s of imports and session fixtures each). A
# folder that no part names runs in the last part ("the rest"). Each job's output is
# printed when all are done, with a table of what each took.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
MAKE=${MAKE:-make}
logs=.test-logs
rm -rf "$logs"
mkdir -p "$logs"

# name | how | paths. The main suite's parts and their minutes on a quiet run (2026-12-07):
# server ~6.5, faults ~5.5, bench ~4.5, fleet + remote + cuda ~5, storage + security ~3.5,
# engine + cache ~3, the rest (fuzz, tests/*.py, tests/vllm/parts) ~1.2; tests/vllm ~8.
JOBS=(
  "vllm|vllm|tests/vllm"
  "server|main|tests/server"
  "faults|main|tests/faults"
  "fleet-remote-cuda|main|tests/fleet tests/remote tests/cuda"
  "bench|main|tests/bench"
  "storage-security|main|tests/storage tests/security"
  "engine-cache|main|tests/engine tests/cache"
  "rest|rest|"
  "mypy|mypy|"
)
# Workers: one per core. A third one packs the cores better but slows what runs beside it.
WORKERS=${TEST_WORKERS:-2}

now() { date +%s; }

# The vLLM venv's packages, meanwhile (their status in a file: a worker waits for it).
(
  "$MAKE" --no-print-directory vllm-packages >"$logs/vllm-install.log" 2>&1
  echo $? >"$logs/vllm-packages.rc"
) &
"$MAKE" --no-print-directory install || exit
bash scripts/ensure-services.sh || exit
.venv/bin/ruff check asynchicache tests || exit
.venv/bin/ruff format --check asynchicache tests || exit

# Ours or torch's per op is measured once for all the jobs, as for one pytest run
# (tests/conftest.py keeps a folder given here).
ASYNCHICACHE_OP_CHOICE_DIR=$(mktemp -d -t asynchicache-op-choice-XXXXXX)
export ASYNCHICACHE_OP_CHOICE_DIR

# Every path the parts name (the rest runs without them).
named=()
for job in "${JOBS[@]}"; do
  IFS='|' read -r _ how paths <<<"$job"
  [ "$how" = main ] || continue # tests/vllm/parts run in the rest (main venv)
  for path in $paths; do named+=("--ignore=$path"); done
done

pytest_main() {
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
  .venv/bin/python -m pytest -q --durations=10 ${PYTEST_ARGS:-} "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && rc=0 # 5: PYTEST_ARGS selected none here
  return "$rc"
}

run_vllm() {
  until [ -f "$logs/vllm-packages.rc" ]; do sleep 1; done
  if [ "$(cat "$logs/vllm-packages.rc")" != 0 ] \
    || ! "$MAKE" --no-print-directory install-vllm >>"$logs/vllm-install.log" 2>&1; then
    echo "installing the vLLM venv failed:"
    tail -n 40 "$logs/vllm-install.log"
    return 1
  fi
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
  .venv-vllm/bin/python -m pytest -q --durations=10 ${PYTEST_ARGS:-} "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && rc=0
  return "$rc"
}

run_job() {
  local i=$1 name how paths rc start
  IFS='|' read -r name how paths <<<"${JOBS[$i]}"
  start=$(now)
  echo "[$(date +%T)] $name: started"
  # shellcheck disable=SC2086  # paths: a list
  case "$how" in
    mypy) .venv/bin/python -m mypy ;;
    vllm) run_vllm $paths ;;
    main) pytest_main $paths ;;
    rest) pytest_main tests "${named[@]}" ;;
  esac >"$logs/job.$i.log" 2>&1
  rc=$?
  echo "$rc $(($(now) - start))" >"$logs/job.$i.rc"
  echo "[$(date +%T)] $name: rc $rc in $(($(now) - start)) s"
}

worker() {
  local i
  for i in "${!JOBS[@]}"; do
    mkdir "$logs/claim.$i" 2>/dev/null || continue # another worker took it
    run_job "$i"
  done
}

began=$(now)
for _ in $(seq 2 "$WORKERS"); do worker & done
worker
wait # the other workers, and the vLLM packages' install when no job waited for it

status=0
for i in "${!JOBS[@]}"; do
  IFS='|' read -r name _ _ <<<"${JOBS[$i]}"
  echo "=== $name ==="
  cat "$logs/job.$i.log"
done
echo "=== what each job took (s; two workers, $(($(now) - began)) s in all) ==="
for i in "${!JOBS[@]}"; do
  IFS='|' read -r name _ _ <<<"${JOBS[$i]}"
  read -r rc seconds <"$logs/job.$i.rc"
  printf '%-18s %5s  rc %s\n' "$name" "$seconds" "$rc"
  [ "$rc" -ne 0 ] && status=1
done
exit "$status"
