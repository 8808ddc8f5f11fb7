#!/usr/bin/env bash
# `make test`: the whole suite. The vLLM venv (~1.5 min of pip on one core, nothing
# to do when it is up to date) installs in the background while the main suite runs,
# which leaves a core idle much of the time (servers starting, waits on signals).
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
log=.venv-vllm.install.log
"$MAKE" --no-print-directory install-vllm >"$log" 2>&1 &
vllm_install=$!

bash scripts/ensure-services.sh || exit
.venv/bin/ruff check asynchicache tests || exit
.venv/bin/ruff format --check asynchicache tests || exit
# The type checker (config: pyproject.toml [tool.mypy]; ~40 s cold, seconds with its cache).
.venv/bin/python -m mypy || exit
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
.venv/bin/python -m pytest -q --durations=25 ${PYTEST_ARGS:-}
main=$?

if ! wait "$vllm_install"; then
  echo "installing $log's venv failed:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
.venv-vllm/bin/python -m pytest -q tests/vllm
vllm=$?
[ "$main" -ne 0 ] && exit "$main"
exit "$vllm"
