"""Continuous batching over the hierarchical cache.

Each step the scheduler (1) collects finished prefix loads, (2) gives up loads
past their deadline, (3) admits waiting requests: matches their prefix, starts
an asynchronous load when the prefix is in a lower tier and loading pays, else
takes what L1 holds, (4) builds a batch of one token per decoding request plus
prefill chunks under a token budget (what the measured pace computes within
--max-step-ms: engine/scheduling/prefill_policy.py), allocating L1 pages as it goes (evicting
cached pages, then preempting the newest request when L1 is full). It never
waits on I/O: a request whose prefix is loading sits in LOADING while the batch
keeps running.

Loads and locks:
* every cache poll goes through `poll()` (the engine's idle loop too), and
  every ticket it returns is taken by its request or unlocked: none is dropped;
* requests wait on loads keyed by `LoadTicket.id` (never `id()` of an object);
* collecting comes before giving up, so a load that landed is used;
* giving up (deadline or abort) hands the request the load's fallback, the L1
  prefix the cache kept locked since the load started (`HiRadixCache.give_up`):
  falling back never locks a handle whose pages were evicted. The given-up
  load is the cache's to release, and counts as work until it finished.

Prefetch at arrival (engine/scheduling/prefetch.py): `add` starts a queued request's
storage -> L2 read at once; `poll` hands its ticket to the prefetcher; a request
admitted while its read is still landing waits in `landing` (it counts as
admitted, as a load would) and is matched once the read is in L2; what landed is
released once the request's own match holds it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from asynchicache.engine.protocol import CachedTokens
from asynchicache.engine.request import Phase, Request
from asynchicache.engine.sampling.sampler import request_generator
from asynchicache.engine.scheduling.batch import Batch, ScheduledSeq, StepFill
from asynchicache.engine.scheduling.cost import CostModel, load_deadline
from asynchicache.engine.scheduling.memory_budget import MemoryBudget
from asynchicache.engine.scheduling.prefetch import ArrivalPrefetcher, by_origin
from asynchicache.engine.scheduling.prefill_policy import (
    QuickLoads,
    StepBudget,
    batch_order,
    chunk_tokens,
)
from asynchicache.engine.scheduling.prefix_join import fresh_page, owns_nothing
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.results import LockedPages, MatchHandle
from asynchicache.settings.config import CacheConfig, EngineConfig

log = logging.getLogger(__name__)


class Scheduler:
    """Owns request queues and page bookkeeping; the engine runs the model."""

    def __init__(
        self,
        engine_config: EngineConfig,
        cache_config: CacheConfig,
        cache: HiRadixCache,
        cost: CostModel,
    ) -> None:
        self.config = engine_config
        self.cache_config = cache_config
        self.cache = cache
        self.cost = cost
        self.page_size = cache_config.page_size
        self.waiting: deque[Request] = deque()
        self.loading: dict[int, Request] = {}  # LoadTicket.id -> request
        self.landing: list[Request] = []  # admitted, waiting for their arrival read (prefetch.py)
        self.running: list[Request] = []
        self.finished: list[Request] = []  # drained by the engine after each step
        self.budget = MemoryBudget(self.page_size, engine_config.decode_reserve_tokens)
        self.preemptions = 0
        self.loads_given_up = 0  # deadlines passed or requests aborted while loading
        self.loads_deferred = 0  # loads that waited a step for L1 room instead of recomputing
        self.joined_tokens = 0  # prompt tokens taken from another prompt's chunks (`_join`)
        self.backing_off = False  # after a preemption, admit nothing until a request ends
        self.prefetcher = ArrivalPrefetcher(cache_config, cache, cost)
        self.quick_loads = QuickLoads(lambda pages: cost.load_seconds(pages, 0))
        self.step_budget = StepBudget(
            engine_config.max_step_ms / 1000, engine_config.max_prefill_tokens
        )

    # ----------------------------------------------------------------- queues
    def add(self, req: Request) -> None:
        if not req.sampling.greedy:
            req.generator = request_generator(req.sampling.seed)
        self.waiting.append(req)
        self.prefetcher.on_arrival(req)

    def abort(self, rid: str, index: int | None = None) -> bool:
        """End `rid`: one member of its group, or (index None) every member."""
        found = [
            r
            for r in [*self.waiting, *self.landing, *self.running, *self.loading.values()]
            if r.rid == rid and index in (None, r.index)
        ]
        for req in found:
            self.finish(req, "abort")
        return bool(found)

    @property
    def has_work(self) -> bool:
        """Requests to serve, or given-up loads still to land (then the cache releases them)."""
        return bool(self.waiting or self.landing or self.loading or self.running
                    or self.cache.abandoned_loads)  # fmt: skip

    def queue_lengths(self) -> dict[str, int]:
        return {
            "waiting": len(self.waiting),
            "loading": len(self.loading) + len(self.landing),
            "running": len(self.running),
            "given_up_loads": self.cache.abandoned_loads,
            "prefetching": self.prefetcher.in_flight,
        }

    # -------------------------------------------------------------- admission
    def _prefix_enabled(self) -> bool:
        return self.cache_config.enable_prefix_cache

    def _start(self, req: Request) -> bool:
        """Match the prompt's prefix; start a load or take what L1 holds.

        False (nothing changed) when a load would find no L1 room: the request
        waits for a later step instead of recomputing what a tier holds.
        """
        if not self._prefix_enabled() or req.needs_whole_prompt:
            req.phase = Phase.RUNNING
            self.running.append(req)
            return True
        tokens = req.tokens
        # Every full page may hit: a prompt cached whole computes its last token alone
        # (`_take_prefix` copies the last page first).
        match = self.cache.match(tokens, salt=req.cache_salt)
        lower = match.host_hit_pages + match.storage_hit_pages
        self.cache.lock(match.handle)
        if lower and self.cost.worth_loading(match.host_hit_pages, match.storage_hit_pages):
            if not self.cache.can_allocate(lower):  # L1 pinned by copies in flight: wait
                self.cache.unlock(match.handle)
                self.loads_deferred += 1
                return False
            ticket = self.cache.load(match)
            if ticket is not None:
                self.cache.unlock(match.handle)  # the load holds its own locks
                req.phase = Phase.LOADING
                req.load_ticket = ticket
                req.load_deadline = load_deadline(self.cache_config, self.cost, lower)
                req.cached = CachedTokens(device=len(match.device_pages) * self.page_size)
                self.loading[ticket.id] = req
                return True
        self._take_prefix(
            req,
            match.handle,
            list(match.device_pages),
            CachedTokens(device=len(match.device_pages) * self.page_size),
        )
        return True

    def _take_prefix(
        self, req: Request, handle: MatchHandle | None, pages: list[int], cached: CachedTokens
    ) -> None:
        req.handle = handle
        req.page_table = pages
        req.shared_pages = len(pages)
        if handle is not None and pages and req.cache_store:
            self.cache.claim_stores(handle, len(req.prompt))
        req.num_computed = len(pages) * self.page_size
        if req.num_computed >= req.num_tokens:
            cached = self._recompute_last_token(req, cached)
        if not req.usage_final:  # a preempted request keeps the usage of its first admission
            # A first token drawn early (engine/sampling/prompt_logits.py) may sit on a cached page.
            req.cached = cached.less(max(0, cached.total - len(req.prompt)))
        req.phase = Phase.RUNNING
        self.running.append(req)

    def _recompute_last_token(self, req: Request, cached: CachedTokens) -> CachedTokens:
        """Every token is cached, but sampling needs the last one's logits: compute it
        alone, its KV written into a private copy of the last page (copy-on-write: the
        tree's page stays as it is). Without room for the copy, the last page is
        computed again instead. Returns `cached` less what is computed."""
        last = req.page_table[-1]
        copy = self.cache.copy_page(last)
        recomputed = 1 if copy is not None else self.page_size
        req.page_table[-1:] = [copy] if copy is not None else []
        req.shared_pages -= 1
        req.num_computed -= recomputed
        return cached.less(recomputed)

    def _give_up_late_loads(self) -> None:
        now = time.monotonic()
        late = [r for r in self.loading.values()
                if r.load_deadline is not None and now > r.load_deadline]  # fmt: skip
        for req in late:
            log.info("load for %s is late; recomputing past its L1 prefix", req.rid)
            fallback = self._give_up(req)
            pages = list(fallback.device_pages)
            self._take_prefix(req, fallback.handle, pages,
                              CachedTokens(device=len(pages) * self.page_size))  # fmt: skip

    def _give_up(self, req: Request) -> LockedPages:
        """Stop waiting for `req`'s load; returns its L1 prefix, locked for `req`."""
        ticket = req.load_ticket
        assert ticket is not None, "only a LOADING request has a load to give up"
        del self.loading[ticket.id]
        req.load_ticket = None
        self.loads_given_up += 1
        return self.cache.give_up(ticket)

    def poll(self, idle: bool = False) -> None:
        """Collect what the cache finished (loads of waiting requests); never blocks.
        `idle`: the engine has no work (waiting stores may start, hierarchy/l2/store_queue.py).

        The only way the engine polls the cache: every ticket is either taken by
        its request or unlocked here.
        """
        for ticket in self.cache.poll(idle):
            if self.prefetcher.take(ticket):
                continue
            req = self.loading.pop(ticket.id, None)
            if req is None:  # nobody waits for it (cannot happen: given-up loads are the cache's)
                log.warning("load %d finished with no request waiting; releasing it", ticket.id)
                if ticket.handle is not None:
                    self.cache.unlock(ticket.handle)
                continue
            req.load_ticket = None
            if not ticket.ok:
                log.info("load for %s fell short (%s); recomputing the rest", req.rid, ticket.error)
            ps = self.page_size
            remote = min(ticket.pages_from_remote, ticket.pages_from_storage)
            found = CachedTokens(
                device=req.cached.device,
                host=ticket.pages_from_host * ps,
                disk=(ticket.pages_from_storage - remote) * ps,
                remote=remote * ps,
            )
            cached = by_origin(found, req.prefetched)
            self._take_prefix(req, ticket.handle, list(ticket.device_pages), cached)
            self.cost.observe_load(
                ticket.pages_from_host, ticket.pages_from_storage, ticket.elapsed_s
            )
            req.load_ticket_s += ticket.elapsed_s
            req.loaded_host_pages += ticket.pages_from_host
            req.loaded_storage_pages += ticket.pages_from_storage

    def _admit(self) -> None:
        """Start the oldest waiting requests while L1 can hold them
        (engine/scheduling/memory_budget.py)."""
        self._start_landed()
        if not self.waiting:
            return
        busy = bool(self.running or self.loading or self.landing)
        if self.backing_off and busy:
            return
        self.backing_off = False
        admitted = [*self.running, *self.loading.values(), *self.landing]
        room = self.cache.available_pages() - self.budget.outstanding(admitted)
        limit = self.config.max_running_requests
        while self.waiting and len(self.running) + len(self.loading) + len(self.landing) < limit:
            req = self.waiting[0]
            locked = (self.cache.locked_prefix_pages(req.tokens, req.cache_salt)
                      if self._prefix_enabled() else 0)  # fmt: skip
            need = self.budget.need(req, locked)
            # With nothing admitted, a request that does not fit runs all the same
            # (its pages are found or it fails), unless copies in flight pin L1.
            if need > room and (busy or self.cache.copies_pending):
                return
            if self.prefetcher.waiting_on(req):
                # Its read is landing in L2: admitted, it waits for the read as it would
                # for a load started now (engine/scheduling/prefetch.py), then loads from L2.
                self.landing.append(req)
            elif not self._start(req):
                return
            else:
                self.prefetcher.release(req)  # its match holds the prefetched pages now
            self.waiting.popleft()
            room -= need
            busy = True

    def _start_landed(self) -> None:
        """Admitted requests whose arrival read landed (or was given up): match and load."""
        for req in list(self.landing):
            if self.prefetcher.waiting_on(req) or not self._start(req):
                continue  # still reading, or no L1 room for its copy yet
            self.prefetcher.release(req)
            self.landing.remove(req)

    # ------------------------------------------------------------- batching
    def schedule(self) -> Batch:
        """The next batch."""
        # Landed loads first: a load that arrived is used even if its deadline passed
        # while the engine was busy; then the ones still out past their deadline go.
        self.poll()
        self._give_up_late_loads()
        self.prefetcher.top_up()
        loading = set(self.loading)
        self._admit()
        # L2-only loads just started land in milliseconds: in this step (prefill_policy.py).
        self.quick_loads.wait([r for t, r in self.loading.items() if t not in loading], self.poll)
        self._join_computed_prefixes()
        return self._batch()

    def _batch(self) -> Batch:
        """Decodes first (one token each), then prompts shortest remaining first (the
        cached ones: their first token in this step), at most one of them not finished in
        this step, which fills what is left of the budget; the oldest prompt moves on in
        every step (prefill_policy.py)."""
        prompts = [r for r in self.running if r.phase is Phase.RUNNING and r.is_prefill]
        decodes = sum(r.phase is Phase.RUNNING and not r.is_prefill for r in self.running)
        # Prompt tokens of all requests this step: what the measured pace computes beside
        # the decodes within --max-step-ms, at most --max-prefill-tokens; at most
        # --chunked-prefill-size of one request.
        cost = self.cost
        budget = self.step_budget.prompt_tokens(
            cost.prefill_tok_s.value, decodes, cost.step_fixed_s
        )
        queued = bool(self.waiting or self.loading or self.landing)
        chunk = chunk_tokens(self.config.chunked_prefill_size, budget, prompts, queued)
        fill = StepFill(budget, chunk)
        batch = Batch()
        for req in sorted(self.running, key=batch_order):
            n = fill.tokens_for(req, self._fresh_page(req))
            if n > 0:
                self._take(batch, req, n, fill)
        oldest = min(prompts, key=lambda r: r.arrival, default=None)
        if oldest is not None and oldest.phase is Phase.RUNNING and oldest not in batch:
            n = self.step_budget.floor_tokens(min(oldest.remaining, fill.chunk), fill.spent)
            if n > 0 and self._fresh_page(oldest) not in fill.starts:
                self._take(batch, oldest, n, fill)  # never starved by the hits ahead of it
        return batch

    def _take(self, batch: Batch, req: Request, n: int, fill: StepFill) -> None:
        """`n` new tokens of `req` in `batch`, if L1 has (or preempting makes) their pages."""
        page = self._fresh_page(req) if req.is_prefill else None  # before its pages grow
        if not self._reserve(req, req.num_computed + n, batch):
            return
        batch.seqs.append(ScheduledSeq(req, n))
        if page is not None:
            fill.starts.add(page)
        if req.is_prefill:
            fill.budget -= n
            fill.spent += n
            fill.partials += n < req.remaining

    def _join_computed_prefixes(self) -> None:
        """Prompts that computed nothing of their own yet match again: a prompt admitted
        while another one computed its prefix (both misses, arrived together) takes those
        pages now instead of computing them a second time (`after_forward` shares each
        chunk's full pages as soon as they are computed)."""
        if not self._prefix_enabled():
            return
        for req in list(self.running):  # `_join` moves a request to the end of `running`
            if req.phase is Phase.RUNNING and req.is_prefill and owns_nothing(req, self.page_size):
                self._join(req)

    def _fresh_page(self, req: Request) -> tuple[object, ...] | None:
        """The next full page of a fresh prompt (prefix_join.py): two prompts with one
        such page in a step would compute it twice; the second waits a step and joins."""
        return fresh_page(req, self.page_size) if self._prefix_enabled() else None

    def _join(self, req: Request) -> None:
        joined = self.cache.join_l1_prefix(req.tokens, req.shared_pages, salt=req.cache_salt)
        if joined is None:
            return
        if req.handle is not None:
            self.cache.unlock(req.handle)
        more = (len(joined.device_pages) - req.shared_pages) * self.page_size
        self.joined_tokens += more
        cached = req.cached
        if not req.usage_final:  # a preempted request keeps the usage of its first admission
            cached = dataclasses.replace(cached, device=cached.device + more)
        self.running.remove(req)
        self._take_prefix(req, joined.handle, joined.device_pages, cached)

    def _pages_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(req.page_table))

    def _reserve(self, req: Request, upto: int, batch: Batch) -> bool:
        """Give `req` pages for positions < upto, preempting newer requests if L1 is full."""
        need = self._pages_needed(req, upto)
        while need:
            pages = self.cache.allocate(need)
            if pages is not None:
                req.page_table.extend(pages)
                return True
            victim = self._preemption_victim(req, batch)
            if victim is None:
                total = self.cache.stats().device.total
                if -(-upto // self.page_size) > total:
                    self.finish(req, "error", "the request no longer fits in the device cache")
                # Otherwise pages are held by background copies or loads that
                # will release them: wait for a later step.
                return False
            self._preempt(victim)
        return True

    def _preemption_victim(self, req: Request, batch: Batch) -> Request | None:
        in_batch = {id(s.request) for s in batch.seqs}
        candidates = [r for r in self.running if r is not req and id(r) not in in_batch]
        candidates = [r for r in candidates if r.arrival >= req.arrival] or (
            [] if batch.seqs else candidates
        )
        return max(candidates, key=lambda r: r.arrival, default=None)

    def _preempt(self, req: Request) -> None:
        """Give back a request's pages; what it computed stays cached for its return.

        Admission backs off until a request ends: admitting the preempted request
        again into the same shortage would preempt another (a storm)."""
        self.preemptions += 1
        self.backing_off = True
        req.usage_final = True
        self._release(req, keep_cached=True)
        self.running.remove(req)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    # ----------------------------------------------------------- completion
    def after_forward(self, batch: Batch) -> list[Request]:
        """Advance computed counts; return requests that now need a sample."""
        ready = []
        for seq in batch.seqs:
            req = seq.request
            # A prompt just completed (a chunk, or its last token alone after a whole hit).
            was_prefill = req.is_prefill or not req.output
            req.num_computed += seq.num_new
            if req.remaining == 0:
                ready.append(req)
            if was_prefill and self._prefix_enabled():
                # Share the prompt's full pages with other requests right away, each
                # chunk's too: a prompt on the same prefix joins them (`_join`).
                self._publish_computed(req)
        return ready

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End `req` (stopped, length, abort, error): its pages go to the tree or back."""
        if req.phase is Phase.FINISHED:
            return
        req.finish_reason = reason
        req.error = error
        self.prefetcher.release(req)
        if req.phase is Phase.LOADING:
            # The load runs on (the cache releases it when it lands); its fallback is ours.
            self.cache.unlock(self._give_up(req).handle)
            req.phase = Phase.FINISHED
            self.finished.append(req)
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.landing:
            self.landing.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.backing_off = False  # its pages come back: admission may resume
        self._release(req, keep_cached=True)
        req.phase = Phase.FINISHED
        self.finished.append(req)

    def _release(self, req: Request, keep_cached: bool) -> None:
        """Hand computed full pages to the tree (if caching), free the rest, unlock."""
        if keep_cached and self._prefix_enabled():
            self._publish_computed(req)
        private = req.page_table[req.shared_pages :]
        if private:
            self.cache.free(private)
        if req.shared is not None:  # prompt pages of a request group (engine/group.py)
            self.cache.free(req.shared.release())
            req.shared = None
        if req.handle is not None:
            self.cache.unlock(req.handle)
        req.handle = None
        req.page_table = []
        req.shared_pages = 0
        req.num_computed = 0

    def _publish_computed(self, req: Request) -> None:
        """Insert the computed full pages; the tree's copies replace duplicates."""
        full = req.num_computed // self.page_size
        if full <= req.shared_pages:
            return
        tokens = req.tokens[: full * self.page_size]
        result = self.cache.insert(
            tokens, req.page_table[:full], salt=req.cache_salt, store=req.cache_store
        )
        if req.handle is not None:
            self.cache.unlock(req.handle)
        req.handle = result.handle
        req.page_table[:full] = list(result.device_pages)
        req.shared_pages = full

    def drain_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
