"""`MemoryStorage`: an in-memory `StorageTier` for tests that speaks the real contract.

Like the cache service it reads and writes L2 slots itself, and only when
`poll()` completes (or, for late work, settles) a ticket, so a cache that
touched a slot under I/O would corrupt what is stored or loaded and fail the
byte checks.

It also plays a cache service that runs late, as `storage.base` describes:

* `hold`: nothing completes;
* `expire()`: every queued ticket completes at the next `poll()` as timed out
  (`settled=False`) while its work stays with the "service" (`late`);
* `settle()`: the late work runs now, as a frozen service that wakes up would
  do it (a late load writes its slots, a late store reads them), and each
  ticket's `Settled` follows at the next `poll()`;
* `expire_every = k`: every k-th ticket times out like that on its own;
* `cancel(ticket)`: a queued ticket completes at the next `poll()` as
  cancelled (unsettled) and settles at the one after (the service acknowledged
  a cancel of work it never started). With `cancellable = False` the service
  has already started every ticket: a cancel changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asynchicache.hierarchy.pools import HostPool
from asynchicache.storage.base import Completion, PageLayout, PageRef, Settled, TicketKind


@dataclass
class _Op:
    ticket: int
    kind: TicketKind
    hashes: list[bytes]
    slots: list[int]
    pages: list[PageRef]


class MemoryStorage:
    """An in-memory L3 for tests: pages by hash, moved in `poll()` (or `settle()`)."""

    def __init__(self, pool: HostPool | None) -> None:
        self.pool = pool  # may be set later (an Engine makes its own pool)
        self.pages: dict[bytes, bytes] = {}
        self.ops: list[_Op] = []
        self.hold = False  # when True, nothing completes
        self.cancellable = True
        self.expire_every: int | None = None
        self.load_limit: int | None = None  # deliver at most this many pages per load
        self.next_ticket = 100
        self.stores = 0
        self.loads = 0
        self.late: list[_Op] = []  # timed out for the client, still running in the "service"
        self._expiring: list[_Op] = []
        self._cancelled: list[_Op] = []
        self._settled: list[Settled] = []
        self.cancels = 0
        self.registered: tuple[bytes, str, PageLayout] | None = None

    def exists(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.pages:
                break
            n += 1
        return n

    def submit_load(self, hashes: Sequence[bytes], slots: Sequence[int]) -> int:
        return self._queue(TicketKind.LOAD, list(hashes), list(slots), [])

    def submit_store(self, pages: Sequence[PageRef]) -> int:
        return self._queue(TicketKind.STORE, [], [], list(pages))

    def _queue(self, kind: TicketKind, hashes: list[bytes], slots: list[int], pages: list) -> int:
        self.next_ticket += 1
        op = _Op(self.next_ticket, kind, hashes, slots, pages)
        late = self.expire_every is not None and self.next_ticket % self.expire_every == 0
        (self._expiring if late else self.ops).append(op)
        return self.next_ticket

    def cancel(self, ticket: int) -> None:
        self.cancels += 1
        if not self.cancellable:
            return
        self._cancelled += [op for op in self.ops if op.ticket == ticket]
        self.ops = [op for op in self.ops if op.ticket != ticket]

    def register_pool(self, namespace: bytes, segment: str, layout: PageLayout) -> None:
        self.registered = (namespace, segment, layout)

    def stats(self, timeout_s: float = 1.0) -> None:
        """No service: no counters (as a service that does not answer)."""
        return None

    def stats_snapshot(self, max_age_s: float = 1.0) -> None:
        return None

    def expire(self) -> None:
        """Every queued ticket times out for the client; the service still holds its work."""
        self._expiring += self.ops
        self.ops = []

    def settle(self) -> None:
        """The late work runs now (touching its slots); `Settled` comes at the next poll."""
        for op in self.late:
            self._run(op)
            self._settled.append(Settled(op.ticket, "late reply"))
        self.late = []

    def poll(self) -> list[Completion | Settled]:
        if self.hold:
            return []
        out: list[Completion | Settled] = list(self._settled)
        self._settled = []
        for op in self._cancelled:
            n = len(op.hashes) or len(op.pages)
            out.append(Completion(op.ticket, op.kind, 0, n, "cancelled", settled=False))
            self._settled.append(Settled(op.ticket, "cancel acknowledged"))
        self._cancelled = []
        for op in self._expiring:
            n = len(op.hashes) or len(op.pages)
            out.append(Completion(op.ticket, op.kind, 0, n, "timed out", settled=False))
            self.late.append(op)
        self._expiring = []
        done, self.ops = self.ops, []
        return out + [self._run(op) for op in done]

    def _run(self, op: _Op) -> Completion:
        assert self.pool is not None
        slots = self.pool.slots
        assert slots is not None
        if op.kind == TicketKind.STORE:
            for ref in op.pages:
                self.pages[ref.page_hash] = slots[ref.slot].tobytes()
            self.stores += len(op.pages)
            return Completion(op.ticket, op.kind, len(op.pages), len(op.pages))
        n = self.exists(op.hashes)
        if self.load_limit is not None:
            n = min(n, self.load_limit)
        for h, s in zip(op.hashes[:n], op.slots[:n], strict=True):
            slots[s] = np.frombuffer(self.pages[h], dtype=np.uint8)
        self.loads += n
        error = None if n == len(op.hashes) else f"only {n} pages"
        return Completion(op.ticket, op.kind, n, len(op.hashes), error)

    @property
    def busy(self) -> bool:
        """Work not yet reported or settled."""
        return bool(self.ops or self.late or self._expiring or self._cancelled or self._settled)

    def close(self) -> None:
        pass
