"""A circuit breaker for a tier that may vanish (the L4 remote tier).

While the breaker is open ("down") every request skips the tier at once: a
request must never wait on a dead server. One background prober (the
tier's own thread) waits for `wait_probe()`, tries to reconnect, and reports
`recovered()` or `probe_failed()`; the wait between probes doubles up to a cap,
with jitter so that many instances do not retry in lock step.
"""

from __future__ import annotations

import random
import threading
import time


class CircuitBreaker:
    """Thread-safe up/down state with exponential backoff between probes."""

    def __init__(self, initial_s: float, max_s: float, *, up: bool = False) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"backoff must satisfy 0 < initial ({initial_s}) <= max ({max_s})")
        self._initial = initial_s
        self._max = max_s
        self._delay = initial_s
        self._up = up
        self._next_probe = time.monotonic()  # down at start: probe at once
        self._rng = random.Random()
        self._cond = threading.Condition()
        self.trips = 0
        self.probes_failed = 0
        self.last_error: str | None = None

    @property
    def up(self) -> bool:
        return self._up

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe (0 when up)."""
        return 0.0 if self._up else max(0.0, self._next_probe - time.monotonic())

    def trip(self, reason: str) -> bool:
        """Mark the tier down after a failure; True if it was up (the caller logs then)."""
        with self._cond:
            self.last_error = reason
            if not self._up:
                return False
            self._up = False
            self.trips += 1
            self._delay = self._initial
            self._schedule()
            self._cond.notify_all()
            return True

    def probe_failed(self, reason: str) -> None:
        with self._cond:
            self.last_error = reason
            self.probes_failed += 1
            self._delay = min(self._delay * 2, self._max)
            self._schedule()

    def recovered(self) -> None:
        with self._cond:
            self._up = True
            self._delay = self._initial
            self.last_error = None
            self._cond.notify_all()

    def wait_probe(self, stop: threading.Event, poll_s: float = 0.2) -> bool:
        """Block until a probe is due (down and its time has come); False once `stop` is set."""
        with self._cond:
            while not stop.is_set():
                if not self._up:
                    left = self._next_probe - time.monotonic()
                    if left <= 0:
                        return True
                    self._cond.wait(min(left, poll_s))
                else:
                    self._cond.wait(poll_s)
        return False

    def wake(self) -> None:
        """Wake `wait_probe`/`wait_up` callers (e.g. to see a stop event at once)."""
        with self._cond:
            self._cond.notify_all()

    def wait_up(self, timeout_s: float) -> bool:
        """Block until the tier is up or `timeout_s` passed (start-up helper, tests)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._up:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _schedule(self) -> None:
        jitter = self._rng.uniform(0.8, 1.2)
        self._next_probe = time.monotonic() + self._delay * jitter
