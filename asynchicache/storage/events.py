"""KV events of the storage tiers: pages stored to and removed from L3 (disk) and L4 (remote).

The events are asynchicache.common.tiers' (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`: vLLM's names) with the tier `disk` or `remote`: a run of
pages of one chain stored, pages gone from a tier (evicted, cleared, found
damaged, or found gone: another instance evicted them from a shared folder),
every page of the namespace gone at once.

Each namespace's backend in the cache service has one `EventLog`: events get
consecutive sequence numbers in the order the tier changed (the disk index
emits under its lock: storage.page_index), and the service sends them to the
clients that subscribed (`Register.events`), in order, as `StorageEvents`
messages. A client that sees a sequence number jump lost events and asks for
the tier's contents again (`Contents`, whose reply carries the sequence number
it is exact at). The engine relays these into its own stream with its own
sequence (one stream per engine, L1 to L4).

What the disk tier reports is what this service's index holds: pages it
stored, adopted from the folder or found at start-up; an eviction by another
service on a shared folder shows when this one next misses the page. The
remote tier reports what this service stored and removed; values the Redis
server expires or evicts on its own are not seen (a `Contents` request
lists what is there).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asynchicache.common.tiers import AllBlocksCleared, BlockRemoved, BlockStored, Tier, TierEvent
from asynchicache.storage.page_index import IndexedPage


def stored_runs(tier: str, pages: Sequence[IndexedPage]) -> list[BlockStored]:
    """Pages (in chain order) as runs of consecutive pages of one chain."""
    runs: list[list[IndexedPage]] = []
    for page in pages:
        if runs and page.parent and page.parent == runs[-1][-1].page_hash:
            runs[-1].append(page)
        else:
            runs.append([page])
    out = []
    for run in runs:
        known = all(p.tokens for p in run)
        tokens = tuple(t for p in run for t in p.tokens) if known else ()
        hashes = tuple(p.page_hash for p in run)
        out.append(BlockStored(tier, hashes, run[0].parent or None, tokens))
    return out


class EventLog:
    """The numbered events of one namespace's backend, waiting to be sent.

    Only a log someone subscribed to keeps events (`enable`); the numbers
    advance either way. At most `max_pending` wait: past that the oldest are
    dropped, and subscribers see the gap.
    """

    def __init__(self, max_pending: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: deque[tuple[int, TierEvent]] = deque()
        self._max_pending = max_pending
        self._enabled = False
        self._wake: Callable[[], None] | None = None
        self.dropped = 0

    def enable(self, wake: Callable[[], None]) -> None:
        """Keep events from now on; `wake()` is called (any thread) when some are waiting."""
        with self._lock:
            self._enabled = True
            self._wake = wake

    @property
    def seq(self) -> int:
        """The number of the last event emitted (0: none yet)."""
        with self._lock:
            return self._seq

    def emit(self, event: TierEvent) -> None:
        with self._lock:
            self._seq += 1
            if not self._enabled:
                return
            self._pending.append((self._seq, event))
            if len(self._pending) > self._max_pending:
                self._pending.popleft()
                self.dropped += 1
            wake = self._wake
        if wake is not None:
            wake()

    def drain(self) -> list[tuple[int, TierEvent]]:
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
            return out

    def index_listener(self, tier: Tier) -> TierListener:
        return TierListener(self, tier)


@dataclass(frozen=True)
class TierListener:
    """A `storage.page_index.IndexListener` (and a remote backend's sink) emitting into a log."""

    log: EventLog
    tier: Tier

    def stored(self, pages: Sequence[IndexedPage]) -> None:
        for run in stored_runs(self.tier.value, pages):
            self.log.emit(run)

    def removed(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.log.emit(BlockRemoved(self.tier.value, tuple(hashes)))

    def cleared(self) -> None:
        self.log.emit(AllBlocksCleared(self.tier.value))
