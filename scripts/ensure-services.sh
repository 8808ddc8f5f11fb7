#!/usr/bin/env bash
# Installs the system packages the tests use when they are missing.
# Tests start their own redis-server processes on free loopback ports.
set -euo pipefail
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null
  else
    echo "redis-server missing and not root: remote-tier tests will fail" >&2
  fi
fi
