"""Waiting for asynchronous things: a condition that came true, a count that reached a floor
and stopped moving. Tests wait on these signals, not on fixed sleeps. Their timeouts are
the reference host's and scale with this one's speed (host_speed.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from host_speed import scaled

T = TypeVar("T")


def wait_until(
    done: Callable[[], T], what: str, timeout_s: float = 60.0, every_s: float = 0.1
) -> T:
    """`done()`'s first truthy value (asked every `every_s`); fails after `timeout_s`
    (scaled to this host)."""
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def at_most(seconds: float, done: Callable[[], object], every_s: float = 0.1) -> bool:
    """Wait until `done()` or `seconds` passed, whichever is first; whether it is done.

    For a phase of a test that lasts "long enough for X": it ends as soon as X is seen.
    """
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def settled(
    count: Callable[[], int], at_least: int, what: str, quiet_s: float, timeout_s: float
) -> int:
    """`count()` once it is `at_least` and unchanged for `quiet_s`; fails after `timeout_s`
    (scaled to this host)."""
    deadline = time.monotonic() + scaled(timeout_s)
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - since > quiet_s:
            return n
        time.sleep(0.1)
    raise AssertionError(f"{what}: {last}, expected at least {at_least} to settle")
