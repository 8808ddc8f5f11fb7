"""Prefetch at arrival: a queued request's L3/L4 prefix moves into L2 while it waits.

Without it a request's storage read starts only once it is admitted (L1 has room
for it), so under load the read adds to the wait in the queue instead of
overlapping it. As SGLang's HiCache does, the scheduler starts the read when the
request arrives (`Scheduler.add`), into L2 only: no L1 page is taken from the
requests that run. By admission the prefix is an L2 hit, one L2 -> L1 copy away.

The policy, in one place:
* a request asks for at most `PER_REQUEST_SHARE` of L2 (the leading pages of its
  storage part past what the tree holds), and all prefetched pages, in flight or
  landed and not yet taken, stay within `TOTAL_SHARE` of L2 (the rest keeps the
  working set; prefetches must not evict each other's pages either); a request
  that arrives with the budget spent waits its turn (`top_up`, each step, in
  arrival order) while it waits in the queue;
* the pages that landed stay locked for the request until it is admitted (its
  load then holds them) or it ends; nothing else can evict them meanwhile;
* a request admitted while its read is still in flight waits for that read (it is
  admitted: it holds its place and its L1 budget, as a load started then would;
  reading the same pages again would be wasted I/O), at most until the load
  deadline of `--prefetch-policy` (engine/scheduling/cost.py), counted from its admission
  as a load's would be; then the read is given up and
  the request matched as usual: what L2 holds is loaded, the rest loaded or
  recomputed;
* `--no-arrival-prefetch` turns it off: reads start at admission, as before.

A request's usage (and the per-tier hit metrics) still counts the prefetched
tokens in the tier they were read from (`by_origin`): the read was the request's,
only earlier; an L2 hit is a page L2 held before the request came.

Every ticket the cache reports for a prefetch is taken here (`take`); every lock
it carries is released by `release`, once, whatever the request's fate.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from asynchicache.engine.protocol import CachedTokens
from asynchicache.engine.request import Phase, Request
from asynchicache.engine.scheduling.cost import CostModel, load_deadline
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.jobs import LoadTicket
from asynchicache.settings.config import CacheConfig

log = logging.getLogger(__name__)

# Shares of the L2 slots: all prefetched pages together, and one request's.
TOTAL_SHARE = 0.5
PER_REQUEST_SHARE = 0.25


@dataclass
class _Prefetch:
    ticket: LoadTicket
    pages: int  # counted against the budget: asked while reading, landed once done
    # When the admitted request stops waiting for the read (None: never); set at its
    # admission, as a load started then would be: its time in the queue is not counted.
    deadline: float | None = None
    admitted: bool = False
    landed: bool = False  # `poll()` reported the ticket: its handle is ours to unlock


class ArrivalPrefetcher:
    """Starts, tracks and releases the storage -> L2 reads of queued requests."""

    def __init__(self, config: CacheConfig, cache: HiRadixCache, cost: CostModel) -> None:
        self.config = config
        self.cache = cache
        self.cost = cost
        host = cache.stats().host
        slots = host.total if host is not None else 0
        on = config.arrival_prefetch and config.enable_prefix_cache and cache.storage is not None
        self.budget = int(slots * TOTAL_SHARE) if on else 0
        self.per_request = max(1, int(slots * PER_REQUEST_SHARE))
        self._by_request: dict[Request, _Prefetch] = {}
        self._requests: dict[int, Request] = {}  # LoadTicket.id -> request
        self._later: deque[Request] = deque()  # arrived with the budget spent, in order
        self.used = 0  # pages of the budget in use
        self.over_budget = 0  # arrivals that found the budget spent
        self.given_up = 0  # reads admission stopped waiting for

    @property
    def in_flight(self) -> int:
        return sum(not p.landed for p in self._by_request.values())

    def on_arrival(self, req: Request) -> None:
        """Start reading `req`'s storage prefix into L2, within the budget (or later)."""
        if self.budget <= 0 or req.needs_whole_prompt or req in self._by_request:
            return
        if self._later or not self._start(req):
            self.over_budget += 1
            self._later.append(req)

    def top_up(self) -> None:
        """Start the reads of queued requests that arrived with the budget spent."""
        while self._later:
            req = self._later[0]
            waiting = req.phase is Phase.WAITING and req not in self._by_request
            if waiting and not self._start(req):
                return
            self._later.popleft()

    def _start(self, req: Request) -> bool:
        """False when the budget has no room now (nothing started)."""
        room = min(self.per_request, self.budget - self.used)
        if room <= 0:
            return False
        ticket = self.cache.prefetch(req.tokens, room, salt=req.cache_salt)
        if ticket is None:
            return True  # nothing in storage past the tree (or no L2 room): nothing to wait for
        pages = ticket.pages_from_storage
        self._by_request[req] = _Prefetch(ticket, pages)
        self._requests[ticket.id] = req
        self.used += pages
        return True

    def take(self, ticket: LoadTicket) -> bool:
        """Whether `ticket` (from `HiRadixCache.poll`) is a prefetch; it is kept until
        its request is admitted or ends."""
        req = self._requests.get(ticket.id)
        if req is None:
            return False
        entry = self._by_request[req]
        self.used += ticket.pages_from_storage - entry.pages
        entry.pages = ticket.pages_from_storage
        entry.landed = True
        if not ticket.ok:
            log.info("prefetch for %s fell short (%s)", req.rid, ticket.error)
        return True

    def waiting_on(self, req: Request) -> bool:
        """Whether `req`'s read is still landing (then it waits for it before its match).
        Past its deadline the read is given up (False)."""
        entry = self._by_request.get(req)
        if entry is None or entry.landed:
            return False
        if not entry.admitted:  # the first question comes at its admission
            entry.admitted = True
            entry.deadline = load_deadline(self.config, self.cost, entry.pages)
        if entry.deadline is not None and time.monotonic() > entry.deadline:
            self.given_up += 1
            self.release(req)
            return False
        return True

    def release(self, req: Request) -> None:
        """Drop `req`'s prefetch: unlock what landed, or give up a read still running.
        Called once `req` is admitted (its own match holds the pages now) or ends."""
        entry = self._by_request.pop(req, None)
        if entry is None:
            return  # (one still in `_later` is skipped there: no longer WAITING)
        del self._requests[entry.ticket.id]
        self.used -= entry.pages
        ticket = entry.ticket
        if entry.landed:
            assert ticket.handle is not None, "a finished prefetch holds its node"
            ps = self.cache.page_size
            remote = ticket.pages_from_remote
            req.prefetched = CachedTokens(disk=(entry.pages - remote) * ps, remote=remote * ps)
            self.cache.unlock(ticket.handle)
        else:  # reading, or done but not yet reported: the cache releases it
            self.cache.unlock(self.cache.give_up(ticket).handle)

    def stats(self) -> dict[str, int]:
        return {
            "in_flight": self.in_flight,
            "held": len(self._by_request) - self.in_flight,
            "budget_pages": self.budget,
            "used_pages": self.used,
            "over_budget": self.over_budget,
            "given_up": self.given_up,
        }


def by_origin(cached: CachedTokens, prefetched: CachedTokens) -> CachedTokens:
    """`cached` with the L2 hits its arrival prefetch brought counted where they came from."""
    moved = min(cached.host, prefetched.disk + prefetched.remote)
    remote = max(0, moved - prefetched.disk)  # a chain is on disk first, then remote only
    return CachedTokens(
        device=cached.device,
        host=cached.host - moved,
        disk=cached.disk + moved - remote,
        remote=cached.remote + remote,
    )
