"""This vLLM instance's L2 segment, the line to the cache service, and the jobs over them.

The scheduler side (scheduler_side.py) decides what to look up, load and save;
`HostTier` owns what those decisions move: the shared-memory pool and its
slot index (host_index.py), the `ServiceLink`, and every job in flight with
the slots it holds (connector_jobs.py), until the worker or the service reports it:

* worker reports (`worker_reports`): a copy job is done when every
  tensor-parallel rank reported it (ranks.py); a finished save is published
  in L2 and handed to the service to store (`store`), a failed one freed;
* service tickets (`poll`) go through the L2 ticket lifecycle our own hierarchy
  uses, `SlotTickets` (hierarchy/l2/slot_tickets.py): a store finishes and drops
  its readers; a prefetch (L3/L4 -> L2) publishes the pages that landed
  (`Prefetched`) and frees the slots it left empty; a ticket that ended
  unsettled (timed out, or given up by its lookup: `give_up`) keeps its slots
  quarantined (a load's LOAD_QUARANTINED, a store's read) until its `Settled`; a given-up
  prefetch that lands settled still publishes its pages, for later requests;
  the service's "exists" answers go to the lookup that asked;
* KV events (kv_events.py) for what L2 and the service now hold.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from asynchicache.hierarchy.l2.host_index import HostIndex
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.hierarchy.l2.slot_tickets import SlotTickets
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.connector_jobs import Job, JobKind
from asynchicache.integrations.vllm.connector_stats import AsynchicacheStats
from asynchicache.integrations.vllm.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVEventLog
from asynchicache.integrations.vllm.l2.service_link import ExistsAnswer, LinkEvent, ServiceLink
from asynchicache.integrations.vllm.layouts.ranks import ReportTally
from asynchicache.integrations.vllm.metadata import AsynchicacheWorkerMeta
from asynchicache.integrations.vllm.spec import VllmKVSpec
from asynchicache.storage.base import Completion, PageLayout, PageRef, Settled, TicketKind

log = logging.getLogger(__name__)

_SERVICE_JOBS = frozenset({JobKind.PREFETCH, JobKind.STORE})  # booked in `SlotTickets`

_PREFAULT_BYTES = 256 << 20

# A request's chain root and LoRA name (for KV events), while the request is known.
Describe = Callable[[str], tuple[bytes | None, str | None]]


@dataclass(frozen=True)
class Prefetched:
    """A prefetch's outcome: the L2 slots now READY with its leading pages (in order;
    a page another job published first is that job's slot), and the service's report."""

    job: Job
    ready: list[int]
    done: Completion


class HostTier:
    """The L2 pool, its index, the service link and the jobs in flight over them."""

    def __init__(
        self,
        spec: VllmKVSpec,
        config: ConnectorConfig,
        namespace: bytes,
        stats: AsynchicacheStats,
        kv_events: bool,
        describe: Describe,
    ) -> None:
        pages_per_block = spec.block_size // config.page_size
        layout = KVLayout(
            spec.num_layers, spec.page_kv_heads, spec.head_dim, config.page_size, spec.dtype
        )
        slots = max(config.host_cache_bytes // layout.page_bytes, 2 * pages_per_block)
        self.pool = HostPool.create(layout, slots, tag="vllm")
        # Fault the first slots in now (the allocator hands out the lowest first): a
        # fresh shared-memory page costs a fault, which on a busy host made the first
        # saves slow enough to show in the first tokens' latency.
        assert self.pool.tensor is not None
        self.pool.tensor[: min(slots, _PREFAULT_BYTES // layout.page_bytes)].zero_()
        self.index = HostIndex(slots)
        self.stats = stats
        self.events = KVEventLog(kv_events, config.page_size, config.storage_ownership)
        self.index.on_evict = lambda hashes: self.events.removed(hashes, MEDIUM_CPU)
        self._describe = describe
        page = PageLayout(str(spec.dtype).removeprefix("torch."), layout.page_shape)
        self.link = ServiceLink(config, namespace, self.pool.name, page)
        self._ids = itertools.count(1)
        self.jobs: dict[int, Job] = {}  # worker copies (COPY_IN, SAVE_COPY), by job id
        # Service tickets (PREFETCH, STORE) by job id (the link's ticket numbers).
        self.tickets: SlotTickets[Job, Job] = SlotTickets()
        self._reports = ReportTally(spec.tp_size)  # worker reports: one per rank and job

    def next_id(self) -> int:
        return next(self._ids)

    def register(self, job: Job) -> int:
        if job.described is None:  # its request is live now; it may be gone when job is done
            job.described = self._describe(job.req_id)
        job_id = next(self._ids)
        if job.kind in _SERVICE_JOBS:
            self.tickets.add(job_id, job)
        else:
            self.jobs[job_id] = job
        return job_id

    def give_up(self, job_id: int) -> None:
        """The lookup waits no more for prefetch `job_id`: the service is asked to skip it.
        Its slots stay the ticket's until it ends (quarantined while unsettled); what
        lands settled is still published, for later requests."""
        if self.tickets.give_up(job_id):
            self.link.cancel(job_id)

    # -- worker reports ---------------------------------------------------------

    def worker_reports(self, meta: AsynchicacheWorkerMeta) -> list[tuple[Job, bool]]:
        """Copy jobs every rank has reported now, with whether all ranks succeeded.
        Saves are handled here (stored, or freed); loads are returned with their pins
        still held: the caller drops its readers."""
        reports = [(j, True) for j in meta.loads_done + meta.saves_done]
        reports += [(j, False) for j in meta.loads_failed + meta.saves_failed]
        out = []
        for job_id, ok in self._reports.add(reports):
            job = self.jobs.pop(job_id)
            if job.kind is JobKind.SAVE_COPY:
                if ok:
                    self.store(job)
                else:
                    self.index.release(job.slots)
                    self.stats.add("save_errors")
            out.append((job, ok))
        return out

    def store(self, saved: Job) -> None:
        """Publish a finished save's pages in L2 and have the service store them."""
        refs = [r for r in saved.pages if self.index.publish(r.slot, r.page_hash)]
        if not refs:
            return
        slots = [r.slot for r in refs]
        self.index.add_readers(slots)
        self.announce(saved, refs, MEDIUM_CPU)
        job = self.register(
            Job(JobKind.STORE, saved.req_id, slots, refs, described=saved.described)
        )
        self.link.store(job, refs)

    def announce(self, job: Job, refs: list[PageRef], medium: str) -> None:
        """`refs` of `job` now live in `medium` (KV events), named as when it was registered."""
        root, lora_name = job.described or self._describe(job.req_id)
        self.events.stored(refs, medium, root, lora_name)

    # -- service events -----------------------------------------------------------

    def poll(self) -> list[ExistsAnswer | Prefetched]:
        """Settle what the service finished; returns what lookups wait for."""
        out: list[ExistsAnswer | Prefetched] = []
        for event in self.link.events():
            got = self._on_event(event)
            if got is not None:
                out.append(got)
        return out

    def _on_event(self, event: LinkEvent) -> ExistsAnswer | Prefetched | None:
        if isinstance(event, ExistsAnswer):
            return event
        if isinstance(event, Settled):  # the service touches the ticket's slots no more
            record = self.tickets.settle(event)
            if record is not None and record.kind is TicketKind.LOAD:
                self.index.release(record.slots)
            elif record is not None:
                self.index.drop_readers(record.slots)
            return None
        job = self.tickets.take(event.ticket)  # the link's job id
        if job is None:
            return None
        if event.kind is TicketKind.LOAD:
            return self._prefetched(job, event)
        end = self.tickets.store_done(event, job.slots, job)
        self.stats.add("pages_stored", event.pages_ok)
        if event.error:
            self.stats.add("store_failures")
            log.info("asynchicache store: %s", event.error)
        else:
            self.announce(job, job.pages, MEDIUM_STORAGE)
        if not end.quarantined:
            self.index.drop_readers(job.slots)
        return None

    def _prefetched(self, job: Job, done: Completion) -> Prefetched:
        end = self.tickets.read_done(done, job.slots, job)
        ok = len(end.landed)
        if done.error and ok < done.pages_requested:
            self.stats.add("prefetch_failures")
            log.info(
                "asynchicache prefetch: %s (%d of %d pages)", done.error, ok, done.pages_requested
            )
        ready, fresh = [], []
        for ref in job.pages[:ok]:
            if self.index.publish(ref.slot, ref.page_hash):  # a duplicate frees its slot
                fresh.append(ref)
            slot = self.index.slot_of(ref.page_hash)
            if slot is not None:
                ready.append(slot)
        self.announce(job, fresh, MEDIUM_CPU)
        self.index.release(end.empty)
        self.index.quarantine(end.quarantined)  # the service may still write them
        return Prefetched(job, ready, done)

    def check_integrity(self) -> None:
        """The index's own invariants; the slots of unsettled tickets are exactly the
        LOAD_QUARANTINED ones (a load's: never published or reused) and read ones (a
        store's: never evicted) until Settled."""
        self.index.check_integrity()
        loads = sorted(self.tickets.quarantined(TicketKind.LOAD))
        in_ledger = [s for s in range(self.index.num_slots)
                     if self.index.use(s) is SlotState.LOAD_QUARANTINED]  # fmt: skip
        assert loads == in_ledger, f"quarantined: tickets {loads}, ledger {in_ledger}"
        for slot in self.tickets.quarantined(TicketKind.STORE):
            assert self.index.readers(slot) > 0, f"slot {slot} of a late store is not held"

    def close(self) -> None:
        self.link.close()
        self.pool.close()
