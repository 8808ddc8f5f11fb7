"""Answers the engine's thread may read without a round trip: the latest reply to a
periodic question (the service's stats, its pins), and when it came.

`want(kind, max_age_s)` says whether to ask again (the last answer is older than that
and no question is out, or one went unanswered for `lost_s`); the caller sends the
request and records it with `asked`; `take(reply)` keeps a reply that answers one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Snapshots:
    lost_s: float = 5.0  # a question unanswered this long is asked again (a service restart)
    _latest: dict[str, tuple[object, float]] = field(default_factory=dict)
    _asked: dict[str, tuple[int, float]] = field(default_factory=dict)

    def latest(self, kind: str) -> tuple[object, float] | None:
        """The last answer of `kind` and its arrival (CLOCK_MONOTONIC), or None."""
        return self._latest.get(kind)

    def want(self, kind: str, max_age_s: float) -> bool:
        now = time.monotonic()
        asked = self._asked.get(kind)
        if asked is not None and now - asked[1] <= self.lost_s:
            return False
        last = self._latest.get(kind)
        return last is None or now - last[1] > max_age_s

    def asked(self, kind: str, req_id: int) -> None:
        self._asked[kind] = (req_id, time.monotonic())

    def take(self, req_id: int, reply: object) -> bool:
        """Keep `reply` if it answers an outstanding question; whether it did."""
        for kind, (asked_id, _) in self._asked.items():
            if asked_id == req_id:
                del self._asked[kind]
                self._latest[kind] = (reply, time.monotonic())
                return True
        return False
