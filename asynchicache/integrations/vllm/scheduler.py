"""The scheduler half of `AsynchicacheConnector`: lookups, the L2 ledger, job planning.

It runs in vLLM's engine-core process and never waits: the cache service is
reached through `ServiceLink`'s thread, and every answer is collected by a
non-blocking `_poll()` at the start of each entry point.

* Lookups (`get_num_new_matched_tokens`): the prompt's full pages (never the
  last token) are named by our chained hashes; L2 hits are pinned, the
  service is asked how far the chain goes on, and the pages are read into L2
  slots; until then the answer is None (vLLM asks again next step). Only
  pages verified in L2 are offered (see `lookup.py`). A hit is counted in our
  pages, not in vLLM's blocks: its last block may be loaded in part (vLLM
  computes the rest of it), so a restart recomputes less than a page.
* Loads: once vLLM allocated blocks (`update_state_after_alloc`), a load job
  (L2 slots -> blocks) goes to the worker with the next metadata.
* Saves: every full page a step computes (prompt or output) is copied by the
  worker into a fresh L2 slot right after the forward pass; when the worker
  reports it done, the slots are published in L2 and stored by the service.
  vLLM's blocks are therefore never held past the step that filled them.
* The L2 segment belongs to this process; the worker maps it by name.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from asynchicache.cache.pools import HostPool, KVLayout
from asynchicache.integrations.vllm.config import ConnectorConfig
from asynchicache.integrations.vllm.host_index import HostIndex
from asynchicache.integrations.vllm.jobs import Job, JobKind
from asynchicache.integrations.vllm.lookup import Lookup, Phase, RequestChain, TierSplit
from asynchicache.integrations.vllm.metadata import (
    AsynchicacheMetadata,
    AsynchicacheWorkerMeta,
    CopyJob,
)
from asynchicache.integrations.vllm.service_link import (
    ExistsAnswer,
    LinkEvent,
    ServiceConflict,
    ServiceLink,
)
from asynchicache.integrations.vllm.spec import VllmKVSpec
from asynchicache.integrations.vllm.stats import AsynchicacheStats
from asynchicache.storage.base import Completion, PageLayout, PageRef, Settled, TicketKind

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# While a lookup waits on the service, vLLM asks again at once, in a loop that on
# a small machine leaves the service and our link thread no CPU. So a waiting
# lookup sleeps (yields the CPU and the GIL) once per scheduler step, at most
# this long, and wakes as soon as the answer is in.
_YIELD_S = 0.002
_PREFAULT_BYTES = 256 << 20


class SchedulerSide:
    """Owns this vLLM instance's L2 segment, its ledger and the line to the service."""

    def __init__(self, spec: VllmKVSpec, config: ConnectorConfig) -> None:
        self.spec = spec
        self.config = config
        self.page_size = config.page_size
        self.block_size = spec.block_size
        self.pages_per_block = spec.block_size // config.page_size
        layout = KVLayout(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, config.page_size, spec.dtype
        )
        slots = max(config.host_cache_bytes // layout.page_bytes, 2 * self.pages_per_block)
        self.namespace = spec.namespace(config.page_size)
        self.pool = HostPool.create(layout, slots, tag="vllm")
        # Fault the first slots in now (the allocator hands out the lowest first): a
        # fresh shared-memory page costs a fault, which on a busy host made the first
        # saves slow enough to show in the first tokens' latency.
        assert self.pool.tensor is not None
        self.pool.tensor[: min(slots, _PREFAULT_BYTES // layout.page_bytes)].zero_()
        self.index = HostIndex(slots)
        page = PageLayout(str(spec.dtype).removeprefix("torch."), layout.page_shape)
        self.link = ServiceLink(config, self.namespace.encode(), self.pool.name, page)
        # Start-up may wait for a service we start; one we only connect to answers at once.
        wait = config.service_start_timeout if config.start_service else 2.0
        try:
            connected = self.link.wait_connected(wait)
        except ServiceConflict:  # another instance's service, other settings: fail the start
            self.link.close()
            self.pool.close()
            raise
        if not connected:
            log.warning(
                "no asynchicache cache service at %s yet; recomputing until one answers",
                config.service_address,
            )
        self.stats = AsynchicacheStats()
        self.kv_cache_manager: KVCacheManager | None = None
        self._ids = itertools.count(1)
        self._requests: dict[str, Request] = {}
        self._chains: dict[str, RequestChain] = {}
        self._lookups: dict[str, Lookup] = {}
        self._waiting: dict[int, Lookup] = {}  # ASKING or LOADING, by key
        self._jobs: dict[int, Job] = {}
        self._loads: list[CopyJob] = []  # for the worker, with the next metadata
        self._covered: dict[str, int] = {}  # leading pages known stored or being saved
        self._yielded = False  # a waiting lookup slept in this scheduler step
        log.info(
            "asynchicache connector: %d L2 slots of %d tokens in %s, service %s",
            slots,
            config.page_size,
            self.pool.name,
            config.service_address,
        )

    # -- lookups ------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._poll()
        self._requests[request.request_id] = request
        first_page = num_computed_tokens // self.block_size * self.pages_per_block
        lk = self._lookups.get(request.request_id)
        if lk is None or lk.committed or lk.first_page != first_page:
            if lk is not None and not lk.committed:
                self._drop(lk)
            lk = self._start(request, first_page)
        if lk.phase is not Phase.ANSWERED and not self._yielded:
            self._yielded = True
            self.link.wait_events(_YIELD_S)
            self._poll()
        now = time.monotonic()
        if lk.phase is Phase.ASKING and now - lk.started > self.config.lookup_timeout:
            self.stats.add("lookup_timeouts")
            self._answer(lk)
        elif lk.phase is Phase.LOADING and now - lk.loading_since > self.config.prefetch_timeout:
            # Give up on it (the slots stay WRITING until the ticket ends) and recompute.
            self.stats.add("prefetch_failures")
            self.link.cancel(lk.load_job)
            self._answer(lk)
        if lk.phase is not Phase.ANSWERED:
            return None, False
        tokens = lk.answer_pages * self.page_size
        return (tokens, self.config.load_async) if tokens else (0, False)

    def _start(self, request: Request, first_page: int) -> Lookup:
        tokens = request.all_token_ids
        hashes = self._chain(request).extend(tokens)
        max_pages = (len(tokens) - 1) // self.page_size  # vLLM computes the last token
        want = max(0, max_pages - first_page)
        lk = Lookup(next(self._ids), request.request_id, first_page, want, time.monotonic())
        self._lookups[request.request_id] = lk
        self.stats.add("lookups")
        lk.host_slots = self.index.leading(hashes[first_page : first_page + want])
        self.index.pin(lk.host_slots)
        if len(lk.host_slots) == want:
            self._answer(lk)
        elif not self.link.connected:  # no service: what L2 holds, at once
            self.stats.add("service_unavailable")
            self._answer(lk)
        else:
            self._waiting[lk.key] = lk
            self.link.ask_exists(lk.key, hashes[lk.next_page : first_page + want])
        return lk

    def _chain(self, request: Request) -> RequestChain:
        chain = self._chains.get(request.request_id)
        if chain is None:
            salt = request.cache_salt or ""
            ns = self.namespace.with_salt(salt) if salt else self.namespace
            chain = self._chains[request.request_id] = RequestChain(ns.digest(), self.page_size)
        return chain

    def _on_exists(self, lk: Lookup, pages: int) -> None:
        target = lk.next_page + pages
        slots = self.index.allocate(pages) if pages > 0 else None
        if slots is None:
            self._answer(lk)
            return
        chain = self._chains[lk.req_id]
        refs = [
            PageRef(h, (), s)
            for h, s in zip(chain.hashes[lk.next_page : target], slots, strict=True)
        ]
        job = next(self._ids)
        self._jobs[job] = Job(JobKind.PREFETCH, lk.req_id, slots, refs, lk.key)
        self.link.load(job, [r.page_hash for r in refs], slots)
        lk.phase, lk.load_job, lk.loading_since = Phase.LOADING, job, time.monotonic()

    def _on_prefetched(self, job_id: int, job: Job, done: Completion) -> None:
        ok = done.pages_ok if done.settled else 0
        if done.error and ok < done.pages_requested:
            self.stats.add("prefetch_failures")
            log.info(
                "asynchicache prefetch: %s (%d of %d pages)", done.error, ok, done.pages_requested
            )
        ready = []
        for ref in job.pages[:ok]:
            self.index.publish(ref.slot, ref.page_hash)  # a duplicate frees its slot
            ready.append(self.index.slot_of(ref.page_hash))
        if done.settled:
            self.index.release(job.slots[ok:])
            del self._jobs[job_id]
        else:  # the service may still write into them: quarantined until Settled
            job.slots = job.slots[ok:]
        lk = self._waiting.pop(job.lookup_key, None)
        if lk is not None and self._lookups.get(lk.req_id) is lk:
            lk.loaded_slots = [s for s in ready if s is not None]
            self.index.pin(lk.loaded_slots)
            lk.from_remote = min(done.pages_from_remote, len(lk.loaded_slots))
            self._answer(lk)

    def _answer(self, lk: Lookup) -> None:
        """Settle the hit: the verified, pinned L2 pages; unpin the rest."""
        self._waiting.pop(lk.key, None)
        pages = len(lk.slots)
        if pages * self.page_size < self.config.min_load_tokens:
            pages = 0
        split = lk.split(pages)
        self.index.unpin(lk.slots[pages:])
        lk.host_slots = lk.host_slots[: split.host]
        disk_loaded = len(lk.loaded_slots) - lk.from_remote
        lk.loaded_slots = lk.loaded_slots[: split.disk + split.remote]
        lk.from_remote = max(0, len(lk.loaded_slots) - disk_loaded)
        lk.answer_pages = pages
        lk.phase = Phase.ANSWERED
        if pages:
            self.stats.add("lookup_hits")
            log.info(
                "asynchicache hit for %s: %d tokens (%d host, %d disk, %d remote pages) in %.3f s",
                lk.req_id,
                pages * self.page_size,
                split.host,
                split.disk,
                split.remote,
                time.monotonic() - lk.started,
            )

    def _drop(self, lk: Lookup) -> None:
        """Forget an uncommitted lookup: its pins go; a pending answer is ignored."""
        self._waiting.pop(lk.key, None)
        self.index.unpin(lk.slots)  # in every phase, exactly the pinned slots
        lk.host_slots, lk.loaded_slots, lk.answer_pages = [], [], 0
        lk.phase = Phase.ANSWERED

    def hit_split(self, request: Request, num_external_tokens: int) -> TierSplit:
        lk = self._lookups.get(request.request_id)
        if lk is None or not lk.committed:
            return TierSplit()
        return lk.split(num_external_tokens // self.page_size)

    # -- allocation and loads -----------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._poll()
        lk = self._lookups.get(request.request_id)
        if lk is None or lk.committed:
            return
        if num_external_tokens == 0:
            self._drop(lk)
            return
        pages = min(num_external_tokens // self.page_size, lk.answer_pages)
        first_block = lk.first_page // self.pages_per_block
        n_blocks = -(-pages // self.pages_per_block)  # the last one may be loaded in part
        block_ids = blocks.get_block_ids()[0][first_block : first_block + n_blocks]
        slots = lk.slots[:pages]
        self.index.unpin(lk.slots[pages:])
        job = next(self._ids)
        self._jobs[job] = Job(JobKind.COPY_IN, request.request_id, slots)
        self._loads.append(CopyJob(job, request.request_id, tuple(block_ids), tuple(slots)))
        lk.committed = True
        split = lk.split(pages)
        for tier, n in (("host", split.host), ("disk", split.disk), ("remote", split.remote)):
            if n:
                self.stats.add(f"hit_tokens_{tier}", n * self.page_size)

    # -- saves --------------------------------------------------------------

    def build_connector_meta(self, out: SchedulerOutput) -> AsynchicacheMetadata:
        self._poll()
        self._yielded = False  # one schedule() call ends here
        meta = AsynchicacheMetadata(self.pool.name, self._loads, [], self.config.load_async)
        self._loads = []
        for new in out.scheduled_new_reqs:
            self._covered[new.req_id] = new.num_computed_tokens // self.page_size
            done = new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_save(new.req_id, done, meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                self._covered[req_id] = computed // self.page_size
            self._plan_save(req_id, computed + out.num_scheduled_tokens.get(req_id, 0), meta)
        return meta

    def _plan_save(self, req_id: str, computed: int, meta: AsynchicacheMetadata) -> None:
        """Save jobs for the full pages computed since the last step that L2 lacks."""
        request = self._requests.get(req_id)
        target = computed // self.page_size
        covered = self._covered.get(req_id, target)
        if request is None or target <= covered or self.kv_cache_manager is None:
            return
        self._covered[req_id] = target
        chain = self._chain(request)
        hashes = chain.extend(request.all_token_ids)
        missing = [p for p in range(covered, target) if self.index.slot_of(hashes[p]) is None]
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        for run in _runs(missing):
            slots = self.index.allocate(len(run))
            if slots is None:
                self.stats.add("saves_skipped")
                return
            meta.saves.append(self._save_job(request, chain, run, slots, block_ids))

    def _save_job(
        self,
        request: Request,
        chain: RequestChain,
        pages: range,
        slots: list[int],
        block_ids: list[int],
    ) -> CopyJob:
        tokens, size, ppb = request.all_token_ids, self.page_size, self.pages_per_block
        refs = [
            PageRef(chain.hashes[p], tuple(tokens[p * size : (p + 1) * size]), s, chain.parent(p))
            for p, s in zip(pages, slots, strict=True)
        ]
        job = next(self._ids)
        self._jobs[job] = Job(JobKind.SAVE_COPY, request.request_id, slots, refs)
        first, last = pages[0] // ppb, (pages[-1] // ppb) + 1
        return CopyJob(
            job,
            request.request_id,
            tuple(block_ids[first:last]),
            tuple(slots),
            pages[0] - first * ppb,
        )

    # -- worker and service reports -------------------------------------------

    def on_worker_meta(self, meta: Any) -> None:
        self._poll()
        if not isinstance(meta, AsynchicacheWorkerMeta):
            return
        for job_id in meta.loads_done + meta.loads_failed:
            job = self._jobs.pop(job_id)
            self.index.unpin(job.slots)
        for job_id in meta.saves_failed:
            self.index.release(self._jobs.pop(job_id).slots)
            self.stats.add("save_errors")
        for job_id in meta.saves_done:
            self._store(self._jobs.pop(job_id))
        self.stats.add("load_errors", len(meta.loads_failed))

    def _store(self, saved: Job) -> None:
        refs = [r for r in saved.pages if self.index.publish(r.slot, r.page_hash)]
        if not refs:
            return
        slots = [r.slot for r in refs]
        self.index.pin(slots)
        job = next(self._ids)
        self._jobs[job] = Job(JobKind.STORE, saved.req_id, slots)
        self.link.store(job, refs)

    def _poll(self) -> None:
        for event in self.link.events():
            self._on_event(event)

    def _on_event(self, event: LinkEvent) -> None:
        if isinstance(event, ExistsAnswer):
            lk = self._waiting.get(event.key)
            if lk is not None and lk.phase is Phase.ASKING:
                self._on_exists(lk, event.pages)
            return
        job = self._jobs.get(event.ticket)  # the link's job id
        if job is None:
            return
        if isinstance(event, Settled):
            del self._jobs[event.ticket]
            if job.kind is JobKind.PREFETCH:
                self.index.release(job.slots)
            else:
                self.index.unpin(job.slots)
        elif event.kind is TicketKind.LOAD:
            self._on_prefetched(event.ticket, job, event)
        else:
            self.stats.add("pages_stored", event.pages_ok)
            if event.error:
                self.stats.add("store_failures")
                log.info("asynchicache store: %s", event.error)
            if event.settled:
                del self._jobs[event.ticket]
                self.index.unpin(job.slots)

    # -- lifetime -------------------------------------------------------------

    def request_finished(self, request: Request) -> None:
        self._poll()
        req_id = request.request_id
        lk = self._lookups.pop(req_id, None)
        if lk is not None and not lk.committed:
            self._drop(lk)
        self._requests.pop(req_id, None)
        self._chains.pop(req_id, None)
        self._covered.pop(req_id, None)

    def take_stats(self) -> AsynchicacheStats | None:
        self._poll()
        return self.stats.take()

    def shutdown(self) -> None:
        self.link.close()
        self.pool.close()


def _runs(pages: list[int]) -> list[range]:
    """Ascending page numbers as runs of consecutive ones."""
    out: list[range] = []
    for p in pages:
        if out and out[-1].stop == p:
            out[-1] = range(out[-1].start, p + 1)
        else:
            out.append(range(p, p + 1))
    return out
