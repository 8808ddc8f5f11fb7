"""`StoreQueue`: L2 -> storage stores of new pages wait for a quiet engine.

A request's pages are written L1 -> L2 when it finishes and are then stored
below L2. Started at once, that store (97 pages of a 1,557-token prompt, 71
MB read from L2, checksummed and written) overlaps the next request, which
on a small machine is often the same conversation's next turn or the same
prompt again: measured here (2 cores, fresh servers, the prompt repeated right
after it was computed), that request's TTFT was 173-277 ms with the store
under way and 88-100 ms with the store started 0.5 s later. Nothing waits on a
store (the pages stay in L1/L2 meanwhile), so a new page's store waits until
the engine has been idle for `IDLE_S`, or until it has waited `MAX_WAIT_S`
when the engine never goes idle.

A waiting store holds its L2 copies (`host_ref`, as a running store does), so
L2 eviction cannot lose a page before it is stored; `drain`, `clear` and
`close` start every waiting store at once. Holding L2 must not cost the
hierarchy pages: once the waiting stores hold `MAX_HELD_FRACTION` of L2, or an
L1 -> L2 write found no room, every waiting store starts at once (back-to-back
requests with a small L2 otherwise filled it with held pages and skipped the
next requests' writes: they never reached the disk). Pins, hot pages and write-backs on
eviction store at once as before: only the write-through of new pages waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from asynchicache.hierarchy.node import RadixNode

IDLE_S = 0.1  # a follow-up request comes within a few ms of the answer's last token
MAX_WAIT_S = 1.0  # under continuous load: stores go out at most this late
MAX_HELD_FRACTION = 0.25  # of L2's slots: past it, L2 room matters more than a quiet step


@dataclass(frozen=True)
class WaitingStore:
    """The L2 slots of a finished L1 -> L2 write, held on the path to `deepest`."""

    deepest: RadixNode
    slots: tuple[int, ...]
    since: float


class StoreQueue:
    """Stores waiting for their moment (module docstring); the scheduler's thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waiting: list[WaitingStore] = []
        self._idle_since: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def held_slots(self) -> int:
        return sum(len(w.slots) for w in self._waiting)

    def add(self, deepest: RadixNode, slots: tuple[int, ...]) -> None:
        """Queue a store; the caller has taken a `host_ref` hold on `deepest` for it."""
        self._waiting.append(WaitingStore(deepest, slots, self._clock()))

    def due(self, idle: bool, l2_slots: int) -> list[WaitingStore]:
        """Remove and return the stores to start now; `idle`: the engine has no work;
        `l2_slots`: L2's size (past `MAX_HELD_FRACTION` of it held, all start)."""
        if self.held_slots > MAX_HELD_FRACTION * l2_slots:
            return self.take_all()
        now = self._clock()
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        if self._idle_since is not None and now - self._idle_since >= IDLE_S:
            return self.take_all()
        late = [w for w in self._waiting if now - w.since >= MAX_WAIT_S]
        if late:
            self._waiting = [w for w in self._waiting if now - w.since < MAX_WAIT_S]
        return late

    def take_all(self) -> list[WaitingStore]:
        out, self._waiting = self._waiting, []
        return out

    def holds(self) -> list[RadixNode]:
        """The nodes whose paths the waiting stores hold (integrity.py counts them)."""
        return [w.deepest for w in self._waiting]
