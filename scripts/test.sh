#!/usr/bin/env bash
# `make test`: the whole suite. The vLLM venv (~1.5 min of pip on one core, nothing
# to do when it is up to date) installs in the background, then the tests under a real
# vLLM (tests/vllm, ~6 min) run beside the main suite (~15 min): the main suite leaves
# a core idle much of the time (servers starting, waits on signals), and one after the
# other the two took more than the 20 minutes `make test` may take here.
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
install_log=.venv-vllm.install.log
vllm_log=.venv-vllm.tests.log

vllm_suite() {
  if ! "$MAKE" --no-print-directory install-vllm >"$install_log" 2>&1; then
    echo "installing the vLLM venv failed:"
    tail -n 40 "$install_log"
    return 1
  fi
  .venv-vllm/bin/python -m pytest -q --durations=10 tests/vllm
}

bash scripts/ensure-services.sh || exit
.venv/bin/ruff check asynchicache tests || exit
.venv/bin/ruff format --check asynchicache tests || exit
vllm_suite >"$vllm_log" 2>&1 &
vllm_pid=$!
# The type checker (config: pyproject.toml [tool.mypy]; ~40 s cold, seconds with its cache).
if ! .venv/bin/python -m mypy; then
  pkill -TERM -P "$vllm_pid" 2>/dev/null; kill "$vllm_pid" 2>/dev/null
  exit 1
fi
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
.venv/bin/python -m pytest -q --durations=25 ${PYTEST_ARGS:-}
main=$?

wait "$vllm_pid"
vllm=$?
echo "=== tests/vllm (under .venv-vllm, run beside the main suite) ==="
cat "$vllm_log"
[ "$main" -ne 0 ] && exit "$main"
exit "$vllm"
