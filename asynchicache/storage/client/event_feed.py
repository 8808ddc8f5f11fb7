"""The client's side of the KV event stream: numbers checked, gaps detected.

The service numbers each namespace's events; a subscribed client receives them
in order (storage.events). `EventFeed` keeps what arrived for the engine's
next `take()`, drops what it already has (numbers at or below the last one,
e.g. events older than its subscription), and raises `gap` when numbers jump
(the service's queue overflowed) or the subscription restarted (a new service
process, a re-registration after the service forgot us): events were lost,
so the engine asks for `StorageClient.contents()` and rebuilds from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asynchicache.common.tiers import TierEvent
from asynchicache.storage.admin_messages import StorageEvents


@dataclass(frozen=True)
class EventBatch:
    """Events since the last `take()`, numbered; `gap`: some were lost before these."""

    events: list[tuple[int, TierEvent]] = field(default_factory=list)
    gap: bool = False


class EventFeed:
    def __init__(self) -> None:
        self.last: int | None = None  # the number of the last event taken in
        self._subscription: tuple[int, int] | None = None  # (service pid, events_from)
        self._pending: list[tuple[int, TierEvent]] = []
        self._gap = False
        self.lost = 0  # events known lost (numbers skipped)
        self.gaps = 0

    def subscribed(self, pid: int, events_from: int) -> None:
        """A RegisterReply: a subscription other than the current one starts a new stream."""
        if (pid, events_from) == self._subscription:
            return
        if self._subscription is not None:
            self._pending = []  # another stream's numbers: the replay supersedes them
            self._mark_gap()
        self._subscription = (pid, events_from)
        self.last = events_from

    def received(self, msg: StorageEvents) -> None:
        if self.last is None:
            return  # not subscribed yet: nothing to continue from
        for i, event in enumerate(msg.events):
            number = msg.seq + i
            if number <= self.last:
                continue
            if number != self.last + 1:
                self.lost += number - self.last - 1
                self._mark_gap()
            self._pending.append((number, event))
            self.last = number

    def take(self) -> EventBatch:
        batch = EventBatch(self._pending, self._gap)
        self._pending, self._gap = [], False
        return batch

    def _mark_gap(self) -> None:
        self._gap = True
        self.gaps += 1
