"""HiRadixCache: the one object the scheduler talks to.

It owns the radix tree, the L1 device pool, the L2 shared-memory host pool,
the page ledger of both, the transfer engine for L1<->L2 copies, and
(optionally) drives a `StorageTier` for L3/L4. Everything runs on the
scheduler's thread; background copies and storage I/O report back through
`poll()`, which never blocks. The work is split by direction of traffic:
`Evictor` (eviction.py) makes room, `Writer` (writes.py) moves pages down,
`PageLoads` (loads.py) moves them up, `FinishedTickets` (finished_tickets.py) routes what
finished to them; `CacheParts` (parts.py) is what they share.

Invariants (checked by `check_integrity()`, see integrity.py):
* every L1 page and L2 slot has exactly one state in the ledger (ledger.py),
  changed only by the transitions written there; the free lists are the FREE
  states: an L1 page is free, private to a request (`allocate`), cached in one
  tree node, or filling for a load; an L2 slot is free, in one tree node
  (writing, ready, storing, stored, store-quarantined), loading, or
  load-quarantined;
* every tree node lives in L1 or L2 (a node that lives nowhere is removed), and
  L1 residency is prefix-closed (a node in L1 has its parent in L1);
* background work holds the deepest node it touches: an L1->L2 write or a load
  locks it (nothing it reads or writes can be evicted); an L2->storage store
  only holds its L2 copy (`host_ref`), so a slow disk does not pin L1 pages;
* storage work that may outlive its ticket (a `Completion` with
  `settled=False`) keeps its slots quarantined until the ticket's `Settled`:
  never freed, reused or evicted. Past `max_quarantine_fraction` of the L2
  slots quarantined, no new storage load or store starts (recompute instead);
* every load finishes, once, with a lock for its collector; a given-up load's
  result is released by the cache itself.

Whether an L2 slot's bytes are valid, being written or persisted is tracked per
slot, not per node, so a completion only needs its slot list and stays correct
when the node was split meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from asynchicache.common.keys import Namespace
from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.clearing import CacheClear, clear_tiers
from asynchicache.hierarchy.eviction import Evictor
from asynchicache.hierarchy.integrity import IntegrityError, integrity_problems
from asynchicache.hierarchy.l2.finished_tickets import FinishedTickets
from asynchicache.hierarchy.l2.jobs import LoadTicket
from asynchicache.hierarchy.l2.ledger import PageState, strict_from_env
from asynchicache.hierarchy.l2.loads import PageLoads
from asynchicache.hierarchy.l2.transfer import TransferEngine
from asynchicache.hierarchy.l2.writes import Writer
from asynchicache.hierarchy.lookup import l1_pages, locked_l1_pages, lookup, stored_after
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.ownership import check_freeable, check_insertable
from asynchicache.hierarchy.parts import CacheParts, snapshot
from asynchicache.hierarchy.pins import PinnedPages
from asynchicache.hierarchy.pools import DevicePool, HostPool, KVLayout, cache_host_pool
from asynchicache.hierarchy.radix import RadixTree
from asynchicache.hierarchy.residency import Residency
from asynchicache.hierarchy.results import LockedPages, MatchHandle, MatchResult
from asynchicache.hierarchy.stats import CacheStats, Counters
from asynchicache.settings.config import CacheConfig
from asynchicache.storage.base import StorageTier

log = logging.getLogger(__name__)

__all__ = ["HiRadixCache"]


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens if type(tokens) is list else list(tokens)


class HiRadixCache:
    """Hierarchical radix prefix cache: L1 device pages, L2 shared-memory slots, L3/L4 storage."""

    def __init__(
        self,
        config: CacheConfig,
        layout: KVLayout,
        namespace: Namespace,
        device: torch.device,
        storage: StorageTier | None = None,
        host_pool: HostPool | None = None,
        strict: bool | None = None,
    ) -> None:
        if not config.page_size == layout.page_size == namespace.page_size:
            raise ValueError(
                f"page sizes disagree: --page-size {config.page_size}, layout "
                f"{layout.page_size}, namespace {namespace.page_size}"
            )
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.page_size = config.page_size
        self.device = torch.device(device)
        self.device_pool = DevicePool(layout, config.device_pages, self.device)
        self.host_pool = cache_host_pool(config, layout, self.device, host_pool)
        self._owns_host_pool = host_pool is None
        self.storage = storage if self.host_pool is not None else None
        if storage is not None and self.host_pool is None:
            log.warning("storage tier ignored: it needs the host (L2) tier, which is disabled")
        self.tree = RadixTree(self.page_size, namespace.digest())
        self.transfer = TransferEngine(self.device)
        self.counters = Counters()
        self.parts = CacheParts(
            config, layout, self.tree, self.device_pool, self.host_pool, self.transfer,
            self.storage, self.counters, strict_from_env() if strict is None else strict,
        )  # fmt: skip
        self.evictor = Evictor(self.parts)
        self.writer = Writer(self.parts, self.evictor)
        self.evictor.backup = self.writer.backup
        self.loads = PageLoads(self.parts, self.evictor)
        self.finished = FinishedTickets(self.parts, self.writer, self.loads)

    @property
    def pending(self) -> int:
        """Background copies and storage operations in flight or waiting to start."""
        p = self.parts
        return len(p.transfers) + len(p.storage_ops) + len(p.store_queue)

    @property
    def copies_pending(self) -> int:
        """L1 <-> L2 copies in flight (each pins the L1 pages it reads or fills)."""
        return len(self.parts.transfers)

    @property
    def abandoned_loads(self) -> int:
        """Loads given up by their caller that have not finished yet."""
        return self.loads.abandoned

    # -- match, lock --------------------------------------------------------------------------

    def _root(self, salt: str) -> RadixNode:
        """The tree root of a `cache_salt` (tenants never share a page, in any tier)."""
        if not salt:
            return self.tree.root
        return self.tree.root_for(salt, lambda: self.namespace.with_salt(salt).digest())

    def match(
        self, tokens: Sequence[int], max_pages: int | None = None, salt: str = ""
    ) -> MatchResult:
        """Longest cached page prefix of `tokens`, split by tier; at most `max_pages` pages.

        Touches LRU and hit counts. The result's handle is not locked: `lock` it
        before anything else can evict (the next `allocate`, `insert`, `load`).
        """
        tokens = _as_list(tokens)
        ps = self.page_size
        limit = len(tokens) // ps if max_pages is None else min(max_pages, len(tokens) // ps)
        root = self._root(salt)
        if not self.config.enable_prefix_cache or limit <= 0:
            return MatchResult([], 0, 0, MatchHandle(root), ps)
        path = self.tree.match(tokens, limit, root)
        device: list[int] = []
        host_pages = 0
        for node in path:
            if node.device is not None:
                device += node.device
            else:
                host_pages += node.num_pages
        node = path[-1] if path else root
        hashes = self._storage_hits(node, tokens, limit)
        if path:
            self.tree.touch(node)
            self.writer.on_hit(path, len(tokens))
        self.counters.count_match(len(tokens), len(device) * ps, host_pages * ps, len(hashes) * ps)
        handle = MatchHandle(node, tokens if hashes else [], hashes)
        return MatchResult(device, host_pages, len(hashes), handle, ps)

    def _storage_hits(self, node: RadixNode, tokens: list[int], limit: int) -> tuple[bytes, ...]:
        """Hashes of the pages after `node` that storage holds (leading run)."""
        if self.storage is None or node.end_page >= limit:
            return ()
        if self.parts.storage_paused:  # past the quarantine cap: recompute instead
            self.counters.storage_loads_paused += 1
            return ()
        return stored_after(self.tree, self.storage, node, tokens, limit)

    def lock(self, handle: MatchHandle) -> None:
        """Protect the handle's path from eviction (counted; pair with `unlock`)."""
        # A root holds no page: a salted root dropped meanwhile is harmless to lock.
        if not handle.node.is_root and not self.tree.is_attached(handle.node):
            raise ValueError("stale handle: its pages were evicted before it was locked")
        self.tree.lock(handle.node)

    def unlock(self, handle: MatchHandle) -> None:
        if not handle.node.is_root and not self.tree.is_attached(handle.node):
            raise ValueError("unlock of a handle that holds no lock (its node is gone)")
        self.tree.unlock(handle.node)

    def lookup(self, tokens: Sequence[int], salt: str = "") -> dict[str, int]:
        """Cached tokens of `tokens` per tier (device, host, disk, remote), without touching
        LRU or splitting nodes."""
        tokens = _as_list(tokens)
        return lookup(self.tree, self._root(salt), tokens, self.storage)

    # -- requests' private pages --------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` could succeed (free pages plus unlocked cached ones)."""
        return self.evictor.can_allocate(n)

    def available_pages(self) -> int:
        """L1 pages `allocate` could hand out now: free plus unlocked cached ones."""
        return self.evictor.available_pages()

    def join_l1_prefix(
        self, tokens: Sequence[int], have_pages: int, salt: str = ""
    ) -> LockedPages | None:
        """The L1 prefix of `tokens`, locked for the caller, when it is longer than the
        `have_pages` the caller holds (another request computed it since the caller's
        `match`); None otherwise, then nothing is touched or split.

        Cheap enough for every step: a walk of the tree, no storage lookup. Counts the
        new pages as L1 hits (the caller's `match` counted the tokens it asked for).
        """
        if not self.config.enable_prefix_cache:
            return None
        tokens, root = _as_list(tokens), self._root(salt)
        pages = l1_pages(self.tree, root, tokens)
        if pages <= have_pages:
            return None
        path = self.tree.match(tokens, pages, root)
        node = path[-1]
        self.tree.touch(node)
        self.writer.on_hit(path, len(tokens))
        self.tree.lock(node)
        self.counters.count_match(0, (pages - have_pages) * self.page_size, 0, 0)
        device = [p for n in path for p in (n.device or [])]
        return LockedPages(MatchHandle(node), device)

    def locked_prefix_pages(self, tokens: Sequence[int], salt: str = "") -> int:
        """Leading L1 pages of `tokens` that some lock already protects (no touch, no split).

        Admission's question: locking a prompt's L1 prefix takes its unlocked
        pages out of `available_pages()`; these ones are out of it already.
        """
        if not self.config.enable_prefix_cache:
            return 0
        return locked_l1_pages(self.tree, self._root(salt), _as_list(tokens))

    def copy_page(self, src: int) -> int | None:
        """A new private L1 page holding a copy of L1 page `src` (copy-on-write).

        For a prompt that ends on a page boundary and is cached whole: its last
        token is computed again for its logits, and its KV must land in a page
        of its own, not in the tree's. None when L1 has no room.
        """
        if self.parts.device.state(src) not in (PageState.CACHED, PageState.PRIVATE):
            raise ValueError(f"L1 page {src} holds no KV to copy")
        pages = self.allocate(1)
        if pages is None:
            return None
        pool = self.device_pool.tensor  # [pages, layers, 2, page_size, kv_heads, head_dim]
        pool[pages[0]].copy_(pool[src])
        return pages[0]

    def allocate(self, n: int) -> list[int] | None:
        """L1 pages for a running request, evicting unlocked cached pages as needed."""
        return self.evictor.alloc_device(n, PageState.PRIVATE)

    def free(self, pages: Sequence[int]) -> None:
        """Return request-private pages (not ones the tree owns)."""
        check_freeable(self.parts.device, pages)
        self.parts.device.move(pages, PageState.PRIVATE, PageState.FREE)

    # -- insert -------------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        salt: str = "",
        store: bool = True,
    ) -> LockedPages:
        """Hand the full pages of a prompt (and output) to the tree.

        `device_pages[i]` holds page i of `tokens`; each must be private to the
        caller or already the tree's page at that position. Where the tree has
        the tokens already, its page wins and the caller's duplicate is freed.
        Returns a handle locked for the caller and the canonical page list
        (`device_pages` with duplicates replaced; a trailing partial page stays
        the caller's). `store` False (a request's `cache_store: false`): its new
        pages stay in L1/L2, never stored below (writes.py).
        """
        tokens = _as_list(tokens)
        pages = list(device_pages)
        n = len(tokens) // self.page_size
        if len(pages) < n:
            raise ValueError(f"{len(tokens)} tokens need {n} full pages, got {len(pages)}")
        root = self._root(salt)
        if not self.config.enable_prefix_cache or n == 0:
            return LockedPages(MatchHandle(root), pages)
        full = pages[:n]
        check_insertable(self.tree, self.parts.device, tokens, full, root)
        out = self.tree.insert(tokens, full, Tier.DEVICE, start=root)
        self.parts.device.move(out.taken, PageState.PRIVATE, PageState.CACHED)
        self.parts.device.move(out.duplicates, PageState.PRIVATE, PageState.FREE)
        self.counters.inserted_pages += len(out.taken)
        node = out.node
        self.tree.touch(node)
        self.tree.lock(node)
        if not store and out.new_node is not None:
            out.new_node.no_store = True
        elif store:
            self.writer.claim(node, len(tokens))
        self.writer.write_through(node, len(tokens))
        return LockedPages(MatchHandle(node), out.pages + pages[n:])

    def claim_stores(self, handle: MatchHandle, prompt_tokens: int) -> None:
        """A request that stores holds the path to `handle`'s node: pages a `cache_store:
        false` request left there may be stored now, as `insert` does for the pages it
        takes (a hit computes no full page of its own to insert)."""
        if self.config.enable_prefix_cache and self.tree.is_attached(handle.node):
            self.writer.claim(handle.node, prompt_tokens)

    # -- loads --------------------------------------------------------------------------------

    def load(self, match: MatchResult) -> LoadTicket | None:
        """Start bringing the host (and storage) part of `match` into L1; None if nothing to do.

        The pages stay protected while they move. The caller's own lock on
        `match.handle` (if any) is untouched; the finished ticket carries a new
        lock on the L1 prefix, reported once by `poll()`. Until then the L1
        part of the match stays locked for `give_up`.
        """
        return self.loads.submit(match)

    def prefetch(self, tokens: Sequence[int], max_pages: int, salt: str = "") -> LoadTicket | None:
        """Start reading the storage part of `tokens`' prefix (at most `max_pages` pages)
        into L2 only; None when storage holds nothing after the tree's part.

        Neither touches LRU nor counts a match: the request is matched for real at
        admission, where the pages that landed are L2 hits. `poll()` reports the
        ticket once read, its `handle` locking the node the pages landed in; the caller
        unlocks it (or gives the ticket up while it reads).
        """
        tokens = _as_list(tokens)
        limit = len(tokens) // self.page_size
        if self.storage is None or not self.config.enable_prefix_cache or max_pages <= 0:
            return None
        path = self.tree.match(tokens, limit, self._root(salt))
        node = path[-1] if path else self._root(salt)
        hashes = self._storage_hits(node, tokens, limit)[:max_pages]
        return self.loads.submit_prefetch(node, tokens, hashes) if hashes else None

    def give_up(self, ticket: LoadTicket) -> LockedPages:
        """Stop waiting for a load: returns its L1 prefix at submit time, locked for the caller.

        `poll()` will not report the ticket; the cache releases it when it lands.
        """
        return self.loads.give_up(ticket)

    # -- poll -----------------------------------------------------------------------------------

    def poll(self, idle: bool = False) -> list[LoadTicket]:
        """Complete finished copies and storage operations, start stores that are due
        (`idle`: the engine has no work, store_queue.py); returns loads that finished.

        Each returned ticket carries a lock (`ticket.handle`) its caller must release.
        """
        self.finished.poll()
        self.writer.start_waiting_stores(idle)
        self.tree.drop_idle_roots()  # salts looked up but never cached (radix.py)
        return self.loads.collect()

    def start_stores(self) -> None:
        """Start every store waiting for a quiet engine now (store_queue.py)."""
        self.writer.start_waiting_stores(idle=True, now=True)

    def drain(self, timeout_s: float = 30.0) -> list[LoadTicket]:
        """Block until no copy or storage ticket is pending (tests and shutdown only).

        Quarantined slots wait for `Settled`, which may come later.
        """
        deadline = time.monotonic() + timeout_s
        out = self.poll()
        while self.pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pending} cache operations still pending")
            self.start_stores()
            time.sleep(0.0005)
            out += self.poll()
        return out

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, n_pages: int) -> int:
        """Free at least `n_pages` L1 pages from unlocked cached ones; returns pages freed."""
        return self.evictor.evict_device(n_pages, backup=self.evictor.write_back)

    def evict_host(self, n_pages: int) -> int:
        """Free at least `n_pages` L2 slots; returns slots freed."""
        return self.evictor.evict_host(n_pages)

    def clear(self) -> int:
        """Drop every cached page of L1 and L2 that may go (clearing.py); returns how many."""
        return self.clear_tiers().removed

    def clear_tiers(
        self,
        device: bool = True,
        host: bool = True,
        salt: str | None = None,
        include_pinned: bool = False,
    ) -> CacheClear:
        """Empty L1 and/or L2 of one `cache_salt`'s pages (None: every tenant's); pages in
        use stay, pinned ones too unless `include_pinned`. Per-tier counts."""
        roots = self.tree.roots() if salt is None else [self._root(salt)]
        self.start_stores()  # as if they had not waited
        return clear_tiers(self.parts, self.evictor, roots, device, host, include_pinned)

    # -- pins, events ---------------------------------------------------------------------

    @property
    def pins(self) -> PinnedPages:
        """Chains L2 keeps from eviction (pins.py)."""
        return self.parts.pins

    def persist(self, tokens: Sequence[int], salt: str = "") -> int:
        """Store the cached full pages of `tokens` below L2 now (a pin's pages); returns
        how many pages of it the tree holds."""
        tokens = _as_list(tokens)
        path = self.tree.match(tokens, root=self._root(salt))
        self.writer.persist(path)
        return sum(n.num_pages for n in path)

    def residency(self) -> Residency:
        """A reporter of L1/L2 contents as KV events (residency.py)."""
        return Residency(self.tree, self.parts.device, self.parts.host)

    # -- stats, integrity, shutdown ---------------------------------------------------------

    def stats(self) -> CacheStats:
        return snapshot(self.parts)

    def check_integrity(self) -> None:
        """Raise IntegrityError describing every inconsistency found."""
        problems = integrity_problems(self.parts, self.loads)
        if problems:
            raise IntegrityError("; ".join(problems[:20]))

    def close(self) -> None:
        """Start waiting stores, finish copies in flight, then release the pools (the storage
        tier is the caller's: it finishes the stores)."""
        self.start_stores()
        self.transfer.close()
        if self.host_pool is not None and self._owns_host_pool:
            self.host_pool.close()
