"""When a storage job must stop touching the L2 pool: an absolute deadline, or a cancel.

Deadlines cross processes as absolute CLOCK_MONOTONIC nanoseconds
(`time.monotonic_ns()`; every process on a host reads the same clock), set by
the client when it submits a ticket. A relative timeout would start only when
the service happened to read the message, so time spent queued (a frozen or
busy service) would be free, and work could outlive the client's patience.

A job checks `passed()` before every page it reads, writes or copies, so a
`cancel()` (the client's `Cancel`) or the deadline stops it at the next page.
"""

from __future__ import annotations

import threading
import time


class Deadline:
    """An absolute CLOCK_MONOTONIC deadline (or none) and a cancel flag; thread-safe."""

    def __init__(self, at_ns: int | None = None) -> None:
        self.at_ns = at_ns
        self._cancelled = threading.Event()

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """A deadline `seconds` from now."""
        return cls(time.monotonic_ns() + int(seconds * 1e9))

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def passed(self) -> bool:
        """Whether the job must stop: cancelled, or past its deadline."""
        if self._cancelled.is_set():
            return True
        return self.at_ns is not None and time.monotonic_ns() > self.at_ns

    def left_s(self) -> float | None:
        """Seconds left (0 once passed); None when there is no deadline and no cancel."""
        if self._cancelled.is_set():
            return 0.0
        if self.at_ns is None:
            return None
        return max(0.0, (self.at_ns - time.monotonic_ns()) / 1e9)


def passed(deadline: Deadline | None) -> bool:
    """`deadline.passed()`, False for no deadline."""
    return deadline is not None and deadline.passed()
