"""The scheduler half of `AsynchicacheConnector`: lookups, the L2 ledger, job planning.

It runs in vLLM's engine-core process and never waits: the cache service is
reached through `ServiceLink`'s thread, and every answer is collected by a
non-blocking `_poll()` at the start of each entry point.

* Lookups (`get_num_new_matched_tokens`): the prompt's full pages (never the
  last token) are named by our chained hashes; L2 hits are pinned, the
  service is asked how far the chain goes on, and the pages are read into L2
  slots; until then the answer is None (vLLM asks again next step). A lookup
  starts when the request arrives (`on_new_request`, up to `EARLY_LOOKUPS` not
  yet reached by the scheduler), so requests that arrive together are asked
  about together and answered by the time the scheduler reaches them: a lookup
  started only then would take one step per request beyond the first (vLLM
  skips a request whose answer is None for the step), splitting a burst of
  cold prompts into smaller steps than vLLM alone would run. Its pages are read
  into L2 as soon as the service answers. Only pages verified in L2 are offered
  (see `lookup.py`).
* What pays (`load_policy.py`, our engine's rule at rates measured here): pages
  are read into L2 only if reading and copying them beats recomputing them; at
  the scheduler's visit a lookup not answered yet is waited for (None) only if
  what it may still bring saves more than the step the request loses, else the
  request goes at once with what L2 holds; a verified hit is loaded only if
  copying it beats recomputing it. What does not pay is recomputed and counted.
* A hit is counted in our pages, not in vLLM's blocks: its last block may be
  loaded in part (vLLM computes the rest of it), so a restart recomputes less
  than a page.
* Loads: once vLLM allocated blocks (`update_state_after_alloc`), a load job
  (L2 slots -> blocks) goes to the worker with the next metadata.
* Saves (`saves.py`): every full page whose tokens are all known and accepted
  is copied by the worker into a fresh L2 slot right after the forward pass
  that computed it (or a later one, under async scheduling and speculative
  decoding); when the worker reports it done, the slots are published in L2
  and stored by the service. vLLM's blocks are never held for us.
* Names (`request_names.py`): a request's pages are named by its tokens,
  salt, LoRA adapter and multimodal items; a request that cannot be named is
  refused (no lookup, no save) and counted.
* The L2 segment, its slots, the service link and the jobs in flight over
  them are `HostTier`'s (host_tier.py); the segment belongs to this process
  and the worker maps it by name.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.integrations.vllm.block_lookup import Lookup, Phase, RequestChain, TierSplit
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.connector_jobs import Job, JobKind
from asynchicache.integrations.vllm.connector_stats import AsynchicacheStats, hit_size
from asynchicache.integrations.vllm.l2.host_tier import HostTier, Prefetched
from asynchicache.integrations.vllm.l2.service_link import ServiceConflict
from asynchicache.integrations.vllm.load_policy import (
    DISK,
    MIN_PREFILL_TOKENS,
    LoadPolicy,
    StepClock,
)
from asynchicache.integrations.vllm.metadata import (
    AsynchicacheMetadata,
    AsynchicacheWorkerMeta,
    CopyJob,
)
from asynchicache.integrations.vllm.request_names import Refusal, RequestNamer
from asynchicache.integrations.vllm.saves import SavePlanner, saveable_tokens
from asynchicache.integrations.vllm.spec import VllmKVSpec
from asynchicache.storage.base import PageRef

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# While a lookup waits on the service, vLLM asks again at once, in a loop that on
# a small machine leaves the service and our link thread no CPU. So waiting
# lookups sleep (yield the CPU and the GIL) at most this long per scheduler step
# in all, each until its answer is in.
_YIELD_S = 0.002
# Lookups started at arrival and not yet reached by the scheduler: they pin their
# L2 pages early, so a long queue starts the rest when the scheduler reaches them.
EARLY_LOOKUPS = 16


class SchedulerSide:
    """Lookups, loads and saves of vLLM's requests over this instance's `HostTier`."""

    def __init__(self, spec: VllmKVSpec, config: ConnectorConfig, kv_events: bool = False) -> None:
        self.spec = spec
        self.config = config
        self.page_size = config.page_size
        self.block_size = spec.block_size
        self.pages_per_block = spec.block_size // config.page_size
        self.namespace = spec.namespace(config.page_size)
        self.stats = AsynchicacheStats()
        self.host = HostTier(
            spec, config, self.namespace.encode(), self.stats, kv_events, self._describe
        )
        self.pool, self.index, self.link = self.host.pool, self.host.index, self.host.link
        # Start-up may wait for a service we start; one we only connect to answers at once.
        wait = config.service_start_timeout_s if config.start_service else 2.0
        try:
            connected = self.link.wait_connected(wait)
        except ServiceConflict:  # another instance's service, other settings: fail the start
            self.host.close()
            raise
        if not connected:
            log.warning(
                "no asynchicache cache service at %s yet; recomputing until one answers",
                config.service_address,
            )
        self.kv_cache_manager: KVCacheManager | None = None
        self.namer = RequestNamer(self.namespace, config.page_size)
        self._requests: dict[str, Request] = {}
        self._chains: dict[str, RequestChain | Refusal] = {}
        self._lookups: dict[str, Lookup] = {}
        self._waiting: dict[int, Lookup] = {}  # ASKING or LOADING, by key
        self._loads: list[CopyJob] = []  # for the worker, with the next metadata
        self._load_failed: set[str] = set()  # requests a copy into vLLM's blocks failed for
        self.saves = SavePlanner(
            config.page_size, self.pages_per_block, self.index, self.stats, self.host.register
        )
        self._yield_left_s = _YIELD_S  # what waiting lookups may still sleep this step
        self._early: set[str] = set()  # requests whose lookup started at arrival, not yet asked
        assert self.pool.tensor is not None
        self.policy = LoadPolicy.measured(self.pool.tensor, config)
        self.clock = StepClock(self.policy)
        self._read_started: dict[int, float] = {}  # reads into L2 in flight, by job
        log.info(
            "asynchicache connector: %d L2 slots of %d tokens in %s, service %s",
            self.index.num_slots,
            config.page_size,
            self.pool.name,
            config.service_address,
        )
        log.info(
            "asynchicache namespace: model %s, engine %s, %s",
            self.namespace.model_fingerprint,
            self.namespace.engine,
            ", ".join(f"{k}={v}" for k, v in spec.identity.numerics),
        )
        log.info(
            "asynchicache load policy at start (measured live from here): %s",
            self.policy.describe(),
        )

    def check_backends(self, backends: set[str]) -> None:
        """The workers' attention backends: pages are named by the one expected; if a
        worker got another, nothing can be named right and every request is refused."""
        named = self.spec.identity.attention_backend
        if backends and backends != {named}:
            log.error(
                "asynchicache connector: pages are named for attention backend %s but vLLM's "
                "workers run %s; caching is off (every request refused: backend_mismatch)",
                named,
                sorted(backends),
            )
            self.namer.refuse_all = Refusal("backend_mismatch")

    # -- lookups ------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        if len(self._early) < EARLY_LOOKUPS and req_id not in self._lookups:
            self._poll()
            self._early.add(req_id)
            self._start(request, 0)

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
            self._early.discard(request.request_id)
            lk = self._start(request, first_page)
        elif request.request_id in self._early:
            self._early.discard(request.request_id)
            if lk.phase is Phase.ROOM:  # answered before the visit: read now
                lk.loading_since = time.monotonic()
                self._read(lk, give_up=False)
        self._go_unless_worth_waiting(lk)  # not even the step's short sleep otherwise
        self._wait_for(lk)
        now = time.monotonic()
        if lk.phase is Phase.ASKING and now - lk.started > self.config.lookup_timeout_s:
            self.stats.add("lookup_timeouts")
            self._answer(lk)
        elif lk.phase is Phase.ROOM:
            self._read(lk, now - lk.loading_since > self.config.prefetch_timeout_s)
        elif lk.phase is Phase.LOADING and now - lk.loading_since > self.config.prefetch_timeout_s:
            # Give up on it (its slots stay the ticket's until it ends) and recompute.
            self.stats.add("prefetch_failures")
            self.host.give_up(lk.load_job)
            self._answer(lk)
        self._go_unless_worth_waiting(lk)
        if lk.phase is not Phase.ANSWERED:
            return None, False
        tokens = lk.answer_pages * self.page_size
        return (tokens, self.config.load_async) if tokens else (0, False)

    def _go_unless_worth_waiting(self, lk: Lookup) -> None:
        """Answer `lk` now, with what L2 holds, unless what may still come saves more
        than the step the request would lose waiting for it (a read in flight still
        lands in L2, for later requests)."""
        if lk.phase is Phase.ANSWERED:
            return
        if not self.policy.pays(self._pending_pages(lk), DISK, wait=True):
            self.stats.add("lookups_not_waited")
            self._answer(lk)

    @staticmethod
    def _pending_pages(lk: Lookup) -> int:
        """Pages beyond L2's that a lookup not answered yet may still bring."""
        if lk.phase is Phase.ASKING:
            return lk.want_pages - len(lk.host_slots)
        return lk.service_pages

    def _wait_for(self, lk: Lookup) -> None:
        """Sleep until `lk` is answered, within what is left of this step's budget."""
        while lk.phase is not Phase.ANSWERED and self._yield_left_s > 0:
            began = time.monotonic()
            self.link.wait_events(self._yield_left_s)
            self._yield_left_s -= time.monotonic() - began
            self._poll()

    def _start(self, request: Request, first_page: int) -> Lookup:
        tokens = request.all_token_ids
        chain = self._chain(request)
        max_pages = (len(tokens) - 1) // self.page_size  # vLLM computes the last token
        named = isinstance(chain, RequestChain) and request.request_id not in self._load_failed
        want = max(0, max_pages - first_page) if named else 0
        lk = Lookup(self.host.next_id(), request.request_id, first_page, want, time.monotonic())
        self._lookups[request.request_id] = lk
        if not named or not isinstance(chain, RequestChain):  # nothing to look up
            self._answer(lk)
            return lk
        hashes = chain.extend(tokens)
        self.stats.add("lookups")
        lk.host_slots = self.index.leading(hashes[first_page : first_page + want])
        self.index.add_readers(lk.host_slots)
        if len(lk.host_slots) == want or not self.policy.pays(want - len(lk.host_slots), DISK):
            # Nothing more to find, or nothing the service could hold would pay its read.
            self._answer(lk)
        elif not self.link.connected:  # no service: what L2 holds, at once
            self.stats.add("service_unavailable")
            self._answer(lk)
        else:
            self._waiting[lk.key] = lk
            self.link.ask_exists(lk.key, hashes[lk.next_page : first_page + want])
        return lk

    def _chain(self, request: Request) -> RequestChain | Refusal:
        """The request's page names (made once), or why it has none (counted once)."""
        chain = self._chains.get(request.request_id)
        if chain is None:
            chain = self._chains[request.request_id] = self.namer.chain(request)
            if isinstance(chain, Refusal):
                self.stats.add(f"refused_{chain.reason}")
                log.info("asynchicache: %s not cached (%s)", request.request_id, chain.reason)
        return chain

    def _describe(self, req_id: str) -> tuple[bytes | None, str | None]:
        """A request's chain root and LoRA name, for KV events (host_tier.py)."""
        chain = self._chains.get(req_id)
        lora = getattr(self._requests.get(req_id), "lora_request", None)
        root = chain.root if isinstance(chain, RequestChain) else None
        return root, (lora.lora_name if lora is not None else None)

    def _on_exists(self, lk: Lookup, pages: int) -> None:
        lk.service_pages, lk.loading_since = pages, time.monotonic()
        lk.phase = Phase.ROOM
        if pages and not self.policy.pays(pages, DISK):
            # Reading and copying them costs more than recomputing them.
            self.stats.add("skipped_unprofitable")
            self.saves.service_holds(lk.req_id, range(lk.next_page, lk.next_page + pages))
            self._answer(lk)
            return
        # Read at once, also for a lookup started at arrival, so the answer is in when
        # the scheduler reaches the request (EARLY_LOOKUPS bounds the pinned reads).
        self._read(lk, give_up=False)

    def _read(self, lk: Lookup, give_up: bool) -> None:
        """Read the service's pages into L2 once it has room for all of them. L2 full of
        pages being stored or copied frees up within a step or two, and a recompute costs
        more than that wait; at the deadline (`give_up`), what fits is read and the rest
        counted (`loads_skipped`). A chain longer than L2 could ever hold is read in part."""
        pages = min(lk.service_pages, self.index.num_slots - len(lk.host_slots))
        room = min(pages, self.index.room())
        if room < pages and not give_up:
            return  # still ROOM: vLLM asks again next step
        if room < lk.service_pages:
            self.stats.add("loads_skipped", lk.service_pages - room)
        if room == 0:
            # The service's word is all we have (a corrupt file is found, removed and
            # saved again by a later request's read).
            self.saves.service_holds(lk.req_id, range(lk.next_page, lk.next_page + pages))
            self._answer(lk)
            return
        slots = self.index.allocate(room, SlotState.LOADING)
        assert slots is not None  # room() counts exactly the slots allocate can take
        chain = self._chains[lk.req_id]
        assert isinstance(chain, RequestChain)  # refused requests never ask the service
        tokens, size = self._requests[lk.req_id].all_token_ids, self.page_size
        refs = [
            PageRef(chain.hashes[p], tuple(tokens[p * size : (p + 1) * size]), s, chain.parent(p))
            for p, s in zip(range(lk.next_page, lk.next_page + room), slots, strict=True)
        ]
        job = self.host.register(Job(JobKind.PREFETCH, lk.req_id, slots, refs, lk.key))
        self.link.load(job, [r.page_hash for r in refs], slots)
        lk.phase, lk.load_job = Phase.LOADING, job
        self._read_started[job] = time.monotonic()

    def _on_prefetched(self, got: Prefetched) -> None:
        started = self._read_started.pop(got.done.ticket, None)
        remote = min(got.done.pages_from_remote, len(got.ready))
        if started is not None and got.ready and not got.done.error:
            seconds = time.monotonic() - started
            self.policy.observe_read(len(got.ready) - remote, remote, seconds)
        lk = self._waiting.pop(got.job.lookup_key, None)
        if lk is not None and self._lookups.get(lk.req_id) is lk:
            # Only the pages read and verified are held: a page that failed its checks
            # (corrupt, truncated, gone) is recomputed and must be saved again.
            self.saves.service_holds(lk.req_id, range(lk.next_page, lk.next_page + len(got.ready)))
            lk.loaded_slots = got.ready
            self.index.add_readers(lk.loaded_slots)
            lk.from_remote = min(got.done.pages_from_remote, len(lk.loaded_slots))
            self._answer(lk)

    def _answer(self, lk: Lookup) -> None:
        """Settle the hit: the verified, pinned L2 pages; unpin the rest."""
        self._waiting.pop(lk.key, None)
        pages = len(lk.slots)
        if pages and not self.policy.pays(pages):  # a copy out of L2 that costs more
            self.stats.add("skipped_unprofitable")
            pages = 0
        split = lk.split(pages)
        self.index.drop_readers(lk.slots[pages:])
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
        self.index.drop_readers(lk.slots)  # in every phase, exactly the slots it reads
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
        self.index.drop_readers(lk.slots[pages:])
        job = self.host.register(Job(JobKind.COPY_IN, request.request_id, slots))
        self._loads.append(CopyJob(job, request.request_id, tuple(block_ids), tuple(slots)))
        lk.committed = True
        split = lk.split(pages)
        slowest = "host"
        for tier, n in (("host", split.host), ("disk", split.disk), ("remote", split.remote)):
            if n:
                self.stats.add(f"hit_tokens_{tier}", n * self.page_size)
                slowest = tier
        self.stats.add(f"hits_{slowest}_{hit_size(pages * self.page_size)}")

    # -- saves --------------------------------------------------------------

    def build_connector_meta(self, out: SchedulerOutput) -> AsynchicacheMetadata:
        self._poll()
        self._yield_left_s = _YIELD_S  # one schedule() call ends here
        meta = AsynchicacheMetadata(self.pool.name, self._loads, [], self.config.load_async)
        self._loads = []
        for new in out.scheduled_new_reqs:
            self.saves.start(new.req_id, new.num_computed_tokens)
            self._plan_save(new.req_id, new.num_computed_tokens, out, meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                self.saves.start(req_id, computed)
            self._plan_save(req_id, computed, out, meta)
        self.clock.scheduled([j.job for j in meta.loads + meta.saves], out.num_scheduled_tokens)
        # Stores wait while a prefill computes (their service's CPU would slow it).
        prefill = sum(n for n in out.num_scheduled_tokens.values() if n > 1)
        busy = prefill >= MIN_PREFILL_TOKENS
        self.link.hold_stores(time.monotonic() + 1.5 * self.policy.step_s.value if busy else 0.0)
        return meta

    def _plan_save(
        self, req_id: str, computed: int, out: SchedulerOutput, meta: AsynchicacheMetadata
    ) -> None:
        """Save jobs for the pages this step completes with known, accepted tokens."""
        request = self._requests.get(req_id)
        if request is None or self.kv_cache_manager is None:
            return
        chain = self._chain(request)
        if not isinstance(chain, RequestChain):
            return
        tokens = request.all_token_ids
        scheduled = out.num_scheduled_tokens.get(req_id, 0)
        saveable = saveable_tokens(computed, scheduled, len(tokens))
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        meta.saves += self.saves.plan(req_id, chain, tokens, saveable, block_ids)

    # -- worker and service reports -------------------------------------------

    def on_worker_meta(self, meta: Any) -> None:
        self._poll()
        if not isinstance(meta, AsynchicacheWorkerMeta):
            return
        self.clock.reported(
            meta.loads_done + meta.saves_done + meta.loads_failed + meta.saves_failed
        )
        for job, ok in self.host.worker_reports(meta):  # every rank's copy reported
            if job.kind is JobKind.COPY_IN:
                self.index.drop_readers(job.slots)
                if not ok:  # vLLM recomputes it (or aborts it): no new hit
                    self._load_failed.add(job.req_id)
                    self.stats.add("load_errors")

    def _poll(self) -> None:
        for got in self.host.poll():
            if isinstance(got, Prefetched):
                self._on_prefetched(got)
                continue
            lk = self._waiting.get(got.key)
            if lk is not None and lk.phase is Phase.ASKING:
                self._on_exists(lk, got.pages)

    # -- lifetime -------------------------------------------------------------

    def request_finished(self, request: Request) -> None:
        self._poll()
        req_id = request.request_id
        lk = self._lookups.pop(req_id, None)
        if lk is not None and not lk.committed:
            self._drop(lk)
        self._early.discard(req_id)
        self._requests.pop(req_id, None)
        self._chains.pop(req_id, None)
        self._load_failed.discard(req_id)
        self.saves.finish(req_id)

    def take_stats(self) -> AsynchicacheStats | None:
        self._poll()
        return self.stats.take()

    def shutdown(self) -> None:
        self.host.close()
