"""Waiting for asynchronous stores to land: a count that reached a floor and stopped moving."""

from __future__ import annotations

import time
from collections.abc import Callable


def settled(
    count: Callable[[], int], at_least: int, what: str, quiet_s: float, timeout_s: float
) -> int:
    """`count()` once it is `at_least` and unchanged for `quiet_s`; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - since > quiet_s:
            return n
        time.sleep(0.1)
    raise AssertionError(f"{what}: {last}, expected at least {at_least} to settle")
