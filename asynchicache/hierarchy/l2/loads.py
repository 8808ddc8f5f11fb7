"""`PageLoads`: KV pages up the tiers, L3/L4 -> L2 -> L1, as `LoadJob`s with an explicit phase.

A load runs at most two steps, one ticket in flight at a time:

    READING  storage -> L2 read into LOADING slots (only when storage pages were asked for)
    FILLING  one L2 -> L1 copy of every page of the path not on L1, into FILLING pages
    DONE     the ticket holds a lock on the L1 prefix; `poll()` reports it once

A prefetch (`submit_prefetch`) is a load that stops after READING: its pages land
in L2 and its ticket's lock holds the node they landed in (no L1 page is reserved),
so a request still queued finds them there as an L2 hit when it is admitted.

Rules that keep every lock and page accounted for:
* the job locks the match's node (and, once read, the node its storage pages
  landed in) until DONE; `fallback`, the deepest L1 node of the match, stays
  locked for the caller until the ticket is collected by `poll()` or given up
  (`give_up` hands that lock over, so falling back never locks a stale node);
* a given-up load is the cache's: when it finishes, the cache releases its
  result lock itself, so no poll can drop it on the floor;
* a read that timed out unsettled leaves its slots LOAD_QUARANTINED (nothing
  from it is served); they become FREE on the ticket's `Settled` (the storage
  ticket's lifecycle is `SlotTickets`', slot_tickets.py, shared with the vLLM
  connector);
* a completion handler that raises still finishes the load, with an error and
  the fallback prefix (`fail`).
"""

from __future__ import annotations

import itertools
import logging
import time

from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.eviction import Evictor
from asynchicache.hierarchy.l2.jobs import LoadJob, LoadPhase, LoadTicket
from asynchicache.hierarchy.l2.ledger import PageState, SlotState
from asynchicache.hierarchy.l2.transfer import TransferDone
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.parts import CacheParts
from asynchicache.hierarchy.results import LockedPages, MatchHandle, MatchResult
from asynchicache.storage.base import Completion

log = logging.getLogger(__name__)


class PageLoads:
    """The cache's KV page loads (L3/L4 -> L2 -> L1): starts them, steps them through their
    phases and reports them once done. (Not the model weights' `model.loader`.)"""

    def __init__(self, parts: CacheParts, evictor: Evictor) -> None:
        self.parts = parts
        self.evictor = evictor
        self.jobs: dict[int, LoadJob] = {}  # ticket id -> job, until collected or given up
        self._finished: list[LoadJob] = []  # DONE, not yet reported
        self._ids = itertools.count()

    @property
    def abandoned(self) -> int:
        """Given-up loads still running (the cache releases them when they finish)."""
        return sum(job.abandoned for job in self.jobs.values())

    # -- submit -------------------------------------------------------------------------------

    def submit(self, match: MatchResult) -> LoadTicket | None:
        p = self.parts
        anchor = match.handle.node
        if not p.tree.is_attached(anchor):
            raise ValueError("stale match: its pages were evicted; match again")
        path = p.tree.path(anchor)
        first_host = next((i for i, n in enumerate(path) if n.device is None), len(path))
        n_host = sum(n.num_pages for n in path[first_host:])
        hashes = match.handle.storage_hashes if p.storage is not None else ()
        if hashes and p.storage_paused:
            p.counters.storage_loads_paused += 1
            hashes = ()
        if n_host + len(hashes) == 0:
            return None
        fallback = path[first_host - 1] if first_host else p.tree.root_of(anchor)
        prefix = sum(n.num_pages for n in path[:first_host])
        ticket = LoadTicket(next(self._ids), n_host, len(hashes))
        job = LoadJob(ticket, anchor, fallback, prefix + n_host + len(hashes),
                      match.handle.tokens, final=anchor)  # fmt: skip
        p.tree.lock(anchor)
        job.locked.append(anchor)
        p.tree.lock(fallback)
        self.jobs[ticket.id] = job
        reserved = self.evictor.alloc_device(n_host + len(hashes), PageState.FILLING)
        if reserved is None and hashes:
            job.errors.append("no L1 room for the storage pages")
            hashes = ()
            reserved = self.evictor.alloc_device(n_host, PageState.FILLING)
        if reserved is None:
            job.errors.append("no free L1 pages for the load")
            self._finish(job)
            return ticket
        job.reserved = reserved
        if hashes:
            self._start_read(job, hashes)
        if job.phase is not LoadPhase.READING:
            self._start_fill(job)
        return ticket

    def submit_prefetch(
        self, anchor: RadixNode, tokens: list[int], hashes: tuple[bytes, ...]
    ) -> LoadTicket | None:
        """Start reading `hashes` (the pages after `anchor`) from storage into L2 only.

        The ticket finishes with a lock on the node they landed in (`anchor` when none
        did); None when nothing was started (no storage, no L2 room).
        """
        p = self.parts
        if p.storage is None or not hashes or p.storage_paused:
            return None
        ticket = LoadTicket(next(self._ids), 0, len(hashes))
        job = LoadJob(ticket, anchor, anchor, anchor.end_page + len(hashes), tokens,
                      final=anchor, prefetch=True)  # fmt: skip
        # Locked before the read takes its L2 slots: that eviction could otherwise take
        # the anchor itself when it lives in L2 alone (and detach it from the tree).
        p.tree.lock(anchor)
        p.tree.lock(anchor)  # the fallback lock, as for a load (`give_up` hands it over)
        self._start_read(job, hashes)
        if job.phase is not LoadPhase.READING:
            p.tree.unlock(anchor)
            p.tree.unlock(anchor)
            return None  # no L2 room or the read did not start: nothing held, nothing owed
        job.locked.append(anchor)
        self.jobs[ticket.id] = job
        p.counters.prefetches += 1
        return ticket

    def _finish_prefetch(self, job: LoadJob, landed: int) -> None:
        """A prefetch's read is over: its ticket holds the node its pages landed in."""
        t = job.ticket
        t.pages_from_storage = landed
        t.pages_from_remote = min(t.pages_from_remote, landed)
        self.parts.counters.prefetched_pages += landed
        self.parts.tree.lock(job.final)
        self._done(job, MatchHandle(job.final), [])

    def _start_read(self, job: LoadJob, hashes: tuple[bytes, ...]) -> None:
        p = self.parts
        assert p.storage is not None
        slots = self.evictor.alloc_host_upto(len(hashes), SlotState.LOADING)
        if not slots:
            job.errors.append("no L2 room for the storage pages")
            return
        hashes = hashes[: len(slots)]  # the chain's prefix that fits; the rest is recomputed
        try:
            op = p.storage.submit_load(list(hashes), slots)
        except Exception as exc:
            log.exception("storage.submit_load failed")
            job.errors.append(f"storage load not started: {type(exc).__name__}: {exc}")
            p.host.move(slots, SlotState.LOADING, SlotState.FREE)
            return
        job.slots = slots
        job.phase, job.op = LoadPhase.READING, op
        p.tickets.add(op, job)

    # -- reading ------------------------------------------------------------------------------

    def on_read(self, job: LoadJob, c: Completion) -> None:
        p = self.parts
        job.op = None
        slots = job.slots
        end = p.tickets.read_done(c, slots)
        if not end.settled:
            # The service may still write these slots: none of them is read or reused.
            job.read_settled = False
            p.host.move(end.quarantined, SlotState.LOADING, SlotState.LOAD_QUARANTINED)
            p.counters.slots_quarantined += len(end.quarantined)
            p.counters.tickets_late += end.late
        p.host.move(end.empty, SlotState.LOADING, SlotState.FREE)
        job.slots = end.landed
        k = len(end.landed)
        if c.error is not None or k < len(slots):
            job.errors.append(f"storage delivered {k} of {len(slots)} pages: {c.error}")
        job.ticket.pages_from_remote += min(c.pages_from_remote, k)
        p.counters.storage_to_host_pages += k
        p.counters.storage_to_host_bytes += k * p.layout.page_bytes
        if k:
            self._adopt_read(job)
        if job.prefetch:
            self._finish_prefetch(job, k)
            return
        if job.abandoned:  # nobody waits for L1 pages: keep what landed in L2 only
            self._release_reserved(job)
            self._finish(job)
            return
        self._start_fill(job)

    def _adopt_read(self, job: LoadJob) -> None:
        """Hang the slots just read under the anchor (duplicates of what the tree has go)."""
        p = self.parts
        out = p.tree.insert(job.tokens, job.slots, Tier.HOST, start=job.anchor)
        p.host.move(out.taken, SlotState.LOADING, SlotState.STORED)
        p.host.move(out.duplicates, SlotState.LOADING, SlotState.FREE)
        job.slots = []
        p.tree.lock(out.node)
        job.locked.append(out.node)
        job.final = out.node

    # -- filling ------------------------------------------------------------------------------

    def _start_fill(self, job: LoadJob) -> None:
        """Copy every page of the path to `final` that is not on L1 into the reserved pages."""
        p = self.parts
        assert p.host_pool is not None and p.host_pool.tensor is not None
        path = p.tree.path(job.final)
        first = next((i for i, n in enumerate(path) if n.device is None), len(path))
        start = path[first].start_page if first < len(path) else job.final.end_page
        spare = iter(job.reserved)
        dests: list[int | None] = []
        src: list[int] = []
        for node in path[first:]:
            if node.device is not None or node.host is None:
                dests += [None] * node.num_pages
                continue
            seg = list(itertools.islice(spare, node.num_pages))
            if len(seg) < node.num_pages:  # cannot happen: reserved covers the path
                job.errors.append("fewer reserved L1 pages than pages to fill")
                break
            dests += seg
            src += node.host
        used = [d for d in dests if d is not None]
        self._release_reserved(job, keep=used)
        if not used:
            self._finish(job)
            return
        job.fill_start, job.fill_pages = start, dests
        op = p.transfer.submit(p.host_pool.tensor, src, p.device_pool.tensor, used, urgent=True)
        job.phase, job.op = LoadPhase.FILLING, op
        p.transfers[op] = job

    def on_fill(self, job: LoadJob, done: TransferDone) -> None:
        p = self.parts
        job.op = None
        if not done.ok:
            p.counters.transfer_failures += 1
            job.errors.append(f"L2 -> L1 copy failed: {done.error}")
        else:
            p.counters.host_to_device_pages += done.num_pages
            p.counters.host_to_device_bytes += done.num_bytes
        start, dests = job.fill_start, job.fill_pages
        # Positions on a locked path never move (a split keeps them), so slice by page.
        for node in p.tree.path(job.final):
            seg = dests[max(0, node.start_page - start) : max(0, node.end_page - start)]
            if node.end_page <= start or not seg or seg[0] is None:
                continue
            pages: list[int] = seg  # type: ignore[assignment]
            parent_on_l1 = (
                node.parent is None or node.parent.is_root or (node.parent.device is not None)
            )
            if done.ok and node.device is None and parent_on_l1:
                node.device = pages
                p.device.move(pages, PageState.FILLING, PageState.CACHED)
            else:
                p.device.move(pages, PageState.FILLING, PageState.FREE)
        job.reserved, job.fill_pages = [], []
        self._finish(job)

    def _release_reserved(self, job: LoadJob, keep: list[int] | None = None) -> None:
        """Return reserved L1 pages no copy writes (all but `keep`)."""
        kept = set(keep or ())
        extra = [pg for pg in job.reserved if pg not in kept]
        self.parts.device.move(extra, PageState.FILLING, PageState.FREE)
        job.reserved = [pg for pg in job.reserved if pg in kept]

    # -- finishing ----------------------------------------------------------------------------

    def _finish(self, job: LoadJob) -> None:
        p = self.parts
        device: list[int] = []
        last = p.tree.root_of(job.anchor)
        for node in p.tree.path(job.final):
            if node.device is None:
                break
            device += node.device
            last = node
        t = job.ticket
        # Report what reached L1, not what was asked for: a short load is partly recomputed.
        already = job.expected_pages - t.pages_from_host - t.pages_from_storage  # L1 before
        arrived = max(0, len(device) - already)
        t.pages_from_host = min(t.pages_from_host, arrived)
        t.pages_from_storage = min(t.pages_from_storage, arrived - t.pages_from_host)
        t.pages_from_remote = min(t.pages_from_remote, t.pages_from_storage)
        if len(device) < job.expected_pages and not job.errors:
            job.errors.append(f"{len(device)} of {job.expected_pages} pages reached L1")
        p.tree.lock(last)
        if not last.is_root:
            p.tree.touch(last)
        self._done(job, MatchHandle(last), device)

    def _done(self, job: LoadJob, handle: MatchHandle, device: list[int]) -> None:
        """The ticket carries `handle` (locked for it); release the job's own locks."""
        p = self.parts
        for node in job.locked:
            p.tree.unlock(node)
        job.locked = []
        t = job.ticket
        t.done, t.device_pages, t.handle = True, device, handle
        t.ok = not job.errors
        t.error = "; ".join(job.errors) or None
        t.elapsed_s = time.monotonic() - job.started
        if t.ok and (t.pages_from_host or t.pages_from_storage):
            tier = "remote" if t.pages_from_remote else "disk" if t.pages_from_storage else "host"
            p.latency.observe("load", tier, t.elapsed_s)
        job.phase, job.op = LoadPhase.DONE, None
        if not t.ok:
            p.counters.load_failures += 1
        if job.abandoned:
            p.tree.unlock(handle.node)
            del self.jobs[t.id]
        else:
            self._finished.append(job)

    def fail(self, job: LoadJob, error: str) -> None:
        """A completion handler raised: finish with the fallback prefix and an error.

        When a ticket of the job is still in flight its completion finishes the
        job; otherwise every page and slot it holds goes back, except slots an
        unsettled read may still write (quarantined, as always).
        """
        p = self.parts
        job.errors.append(error)
        ops = p.tickets.open if job.phase is LoadPhase.READING else p.transfers
        in_flight = job.op is not None and ops.get(job.op) is job
        if job.phase is LoadPhase.DONE or in_flight:
            return
        filling = [pg for pg in job.reserved if p.device.state(pg) == PageState.FILLING]
        p.device.move(filling, PageState.FILLING, PageState.FREE)
        job.reserved = []
        loading = [s for s in job.slots if p.host.state(s) == SlotState.LOADING]
        if job.read_settled:
            p.host.move(loading, SlotState.LOADING, SlotState.FREE)
        else:
            p.host.move(loading, SlotState.LOADING, SlotState.LOAD_QUARANTINED)
        job.slots = []
        p.tree.lock(job.fallback)
        self._done(job, MatchHandle(job.fallback), self._l1_pages(job.fallback))

    # -- the caller's side --------------------------------------------------------------------

    def collect(self) -> list[LoadTicket]:
        """Finished tickets, each once; their fallback locks are released (`handle` covers it)."""
        done, self._finished = self._finished, []
        for job in done:
            self.parts.tree.unlock(job.fallback)
            del self.jobs[job.ticket.id]
        return [job.ticket for job in done]

    def give_up(self, ticket: LoadTicket) -> LockedPages:
        """Stop waiting for `ticket`: the caller gets its fallback prefix, locked.

        The load may still land (its pages then stay cached for later requests);
        the cache releases its result itself. A storage read not yet started is
        cancelled, and L1 pages reserved for it are returned at once.
        """
        job = self.jobs.get(ticket.id)
        if job is None or job.ticket is not ticket or job.abandoned:
            raise ValueError(f"load {ticket.id} is not in flight (already collected or given up)")
        p = self.parts
        job.abandoned = True
        fallback = LockedPages(MatchHandle(job.fallback), self._l1_pages(job.fallback))
        p.counters.loads_given_up += not job.prefetch
        if job.phase is LoadPhase.DONE:  # finished but not collected yet
            self._finished.remove(job)
            assert ticket.handle is not None
            p.tree.unlock(ticket.handle.node)
            del self.jobs[ticket.id]
        elif job.phase is LoadPhase.READING:
            self._release_reserved(job)  # no copy writes them while the read runs
            self._cancel(job)
        return fallback

    def _cancel(self, job: LoadJob) -> None:
        storage = self.parts.storage
        if storage is None or job.op is None:
            return
        self.parts.tickets.give_up(job.op)  # what lands now is not late: it was cancelled
        try:
            storage.cancel(job.op)
        except Exception:
            log.exception("storage.cancel failed (the load completes or times out instead)")

    def _l1_pages(self, node: RadixNode) -> list[int]:
        pages: list[int] = []
        for n in self.parts.tree.path(node):
            pages += n.device or []
        return pages
