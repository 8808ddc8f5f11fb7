#!/usr/bin/env bash
# `make test`: the whole suite, in two lanes side by side (the machine has two cores; one
# pytest run leaves a core idle much of the time: servers starting, waits on signals).
#   lane 1: the main suite without the lane-2 paths below (~15 min).
#   lane 2: the type checker, the vLLM venv (~1.5 min of pip; nothing to do when it is up
#           to date), the tests under a real vLLM (tests/vllm, ~9 min), then, main venv,
#           tests/bench (~4 min of end-to-end bench runs), tests/fleet (vllm-router in front
#           of real servers, ~2.5 min), tests/cuda (the GPU check's dry run) and the
#           dozen-faults test (~2 min): lane 1 alone ran ~24 min on 2026-12-06.
# One after the other they took more than the 20 minutes `make test` may take here; with
# tests/vllm alone beside the main suite, lane 2 sat idle for its last ~10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
MAKE=${MAKE:-make}
# Main-venv tests that run in lane 2, after tests/vllm (lane 1 ignores them).
LANE2_PATHS=(tests/bench tests/fleet tests/cuda tests/faults/test_service_never_fatal.py)
install_log=.venv-vllm.install.log
lane_log=.venv-vllm.tests.log

lane2() {
  local rc=0
  # The type checker (config: pyproject.toml [tool.mypy]; ~40 s cold, seconds with its cache).
  .venv/bin/python -m mypy || rc=1
  if "$MAKE" --no-print-directory install-vllm >"$install_log" 2>&1; then
    .venv-vllm/bin/python -m pytest -q --durations=10 tests/vllm || rc=1
  else
    echo "installing the vLLM venv failed:"
    tail -n 40 "$install_log"
    rc=1
  fi
  echo "=== ${LANE2_PATHS[*]} (main venv) ==="
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
  .venv/bin/python -m pytest -q --durations=10 ${PYTEST_ARGS:-} "${LANE2_PATHS[@]}"
  local bench=$?
  [ "$bench" -ne 0 ] && [ "$bench" -ne 5 ] && rc=1  # 5: PYTEST_ARGS selected none there
  return "$rc"
}

bash scripts/ensure-services.sh || exit
.venv/bin/ruff check asynchicache tests || exit
.venv/bin/ruff format --check asynchicache tests || exit
lane2 >"$lane_log" 2>&1 &
lane2_pid=$!
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
.venv/bin/python -m pytest -q --durations=25 "${LANE2_PATHS[@]/#/--ignore=}" ${PYTEST_ARGS:-}
main=$?

wait "$lane2_pid"
other=$?
echo "=== mypy, tests/vllm (under .venv-vllm) and ${LANE2_PATHS[*]}, run beside the main suite ==="
cat "$lane_log"
[ "$main" -ne 0 ] && exit "$main"
exit "$other"
