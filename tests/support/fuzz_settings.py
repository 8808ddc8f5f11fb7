"""Hypothesis settings of the fuzz tests (tests/fuzz): how many examples comes from the
environment, so a longer run (scripts/faults-full.sh) needs no edit."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz_settings(env: str, default: int, *also_suppressed: HealthCheck) -> settings:
    """`$env` examples (`default` without it); no deadline and no too-slow check: a busy
    host is slow, not wrong."""
    return settings(
        max_examples=int(os.environ.get(env, str(default))),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, *also_suppressed],
    )
