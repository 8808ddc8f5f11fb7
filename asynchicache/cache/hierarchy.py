"""HiRadixCache: the one object the scheduler talks to.

It owns the radix tree, the L1 device pool, the L2 shared-memory host pool,
the transfer engine for L1<->L2 copies, and (optionally) drives a `StorageTier`
for L3/L4. Everything runs on the scheduler's thread; background copies and
storage I/O report back through `poll()`, which never blocks.

Invariants (checked by `check_integrity()`):
* every L1 page is exactly one of: free, in a tree node, private to a request
  (`allocate`), or reserved by an in-flight load;
* every L2 slot is exactly one of: free, in a tree node, or being read from
  storage;
* every tree node lives in L1 or L2 (a node that lives nowhere is removed), and
  L1 residency is prefix-closed (a node in L1 has its parent in L1);
* background work holds the deepest node it touches: an L1->L2 write or a load
  locks it (nothing it reads or writes can be evicted); an L2->storage store
  only holds its L2 copy (`host_ref`), so a slow disk does not pin L1 pages.

Whether an L2 slot's bytes are valid, being written or persisted is tracked per
slot (`SlotState`), not per node, so a completion only needs its slot list and
stays correct when the node was split meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from functools import partial

import torch

from asynchicache.cache.keys import Namespace, chain_hashes
from asynchicache.cache.pools import DevicePool, HostPool, KVLayout
from asynchicache.cache.radix import RadixNode, RadixTree, Tier
from asynchicache.cache.stats import CacheStats, Counters, Occupancy
from asynchicache.cache.transfer import TransferDone, TransferEngine
from asynchicache.config import CacheConfig, WritePolicy
from asynchicache.storage.base import Completion, PageRef, Settled, StorageTier, TicketKind

log = logging.getLogger(__name__)


class SlotState(IntEnum):
    """What an L2 slot holds."""

    FREE = 0
    WRITING = 1  # L1 -> L2 copy in flight
    READY = 2  # valid bytes
    STORING = 3  # valid, L2 -> storage write in flight
    STORED = 4  # valid and persisted below L2
    LOADING = 5  # storage -> L2 read in flight (not in the tree yet)


VALID_SLOT_STATES = (SlotState.READY, SlotState.STORING, SlotState.STORED)


class IntegrityError(RuntimeError):
    """`check_integrity()` found the cache's bookkeeping inconsistent; the message says how."""


@dataclass(frozen=True, eq=False)
class MatchHandle:
    """Opaque: names a node of the tree for `lock`/`unlock`/`load`."""

    node: RadixNode
    tokens: list[int] = field(default_factory=list, repr=False)
    storage_hashes: tuple[bytes, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a prompt, tier by tier (pages, fastest tier first)."""

    device_pages: list[int]
    host_hit_pages: int
    storage_hit_pages: int
    handle: MatchHandle
    page_size: int

    @property
    def device_tokens(self) -> int:
        return len(self.device_pages) * self.page_size

    @property
    def cached_tokens(self) -> int:
        """Tokens of the prefix found in any tier (device + host + storage)."""
        return (len(self.device_pages) + self.host_hit_pages + self.storage_hit_pages) * (
            self.page_size
        )


@dataclass(eq=False)
class LoadTicket:
    """An L2/L3 -> L1 load. `poll()` returns it once `done`.

    When done, `device_pages` is the whole L1 prefix now available (what was
    already on L1 plus what arrived) and `handle` holds one lock on it for the
    caller, who must `unlock` it. `ok` is False when fewer pages than asked for
    arrived; `error` says why, and the rest must be recomputed.
    """

    id: int
    pages_from_host: int
    pages_from_storage: int
    pages_from_remote: int = 0  # of the storage pages that arrived, those read from L4
    done: bool = False
    ok: bool = False
    device_pages: list[int] = field(default_factory=list)
    handle: MatchHandle | None = None
    error: str | None = None
    elapsed_s: float = 0.0  # submit to completion, for the scheduler's bandwidth estimate


@dataclass(frozen=True)
class InsertResult:
    """A locked handle on the inserted path and the canonical page list for the caller's table."""

    handle: MatchHandle
    device_pages: list[int]


@dataclass(eq=False)
class _Load:
    """Book-keeping of one LoadTicket while it is in flight."""

    ticket: LoadTicket
    anchor: RadixNode  # deepest node of the tree part; storage pages hang below it
    final: RadixNode  # deepest node once everything landed
    expected_pages: int
    tokens: list[int]
    locked: list[RadixNode] = field(default_factory=list)
    spare: list[int] = field(default_factory=list)  # L1 pages reserved for storage pages
    parts: int = 0
    errors: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


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
        self.host_pool = self._make_host_pool(host_pool)
        self._owns_host_pool = host_pool is None
        self.storage = storage if self.host_pool is not None else None
        if storage is not None and self.host_pool is None:
            log.warning("storage tier ignored: it needs the host (L2) tier, which is disabled")
        self.tree = RadixTree(self.page_size, namespace.digest())
        self.transfer = TransferEngine(self.device)
        self.counters = Counters()
        n_slots = self.host_pool.num_slots if self.host_pool is not None else 0
        self._slot_state = [SlotState.FREE] * n_slots
        self._private: set[int] = set()  # L1 pages handed to requests by allocate()
        self._inflight_device: set[int] = set()  # L1 pages reserved by loads
        self._inflight_host: set[int] = set()  # L2 slots being read from storage
        self._on_transfer: dict[int, Callable[[TransferDone], None]] = {}
        self._on_storage: dict[int, Callable[[Completion], None]] = {}
        self._finished_loads: list[LoadTicket] = []
        self._load_ids = itertools.count()

    def _make_host_pool(self, given: HostPool | None) -> HostPool | None:
        if given is not None:
            if given.layout != self.layout or given.allocator is None:
                raise ValueError("host_pool must be an owned HostPool with the cache's layout")
            return given
        if not self.config.host_enabled:
            return None
        slots = self.layout.pages_in(self.config.host_cache_gb * 2**30)
        if slots <= 0:
            raise ValueError(
                f"--host-cache-gb {self.config.host_cache_gb} holds no page of "
                f"{self.layout.page_bytes} bytes"
            )
        return HostPool.create(self.layout, slots, pin_memory=self.device.type == "cuda")

    @property
    def _write_back(self) -> bool:
        return self.host_pool is not None and self.config.write_policy == WritePolicy.WRITE_BACK

    @property
    def pending(self) -> int:
        """Background copies and storage operations in flight."""
        return len(self._on_transfer) + len(self._on_storage)

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
        tokens = tokens if type(tokens) is list else list(tokens)
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
            self._on_hit(path, len(tokens))
        c = self.counters
        c.match_tokens += len(tokens)
        c.device_hit_tokens += len(device) * ps
        c.host_hit_tokens += host_pages * ps
        c.storage_hit_tokens += len(hashes) * ps
        handle = MatchHandle(node, tokens if hashes else [], hashes)
        return MatchResult(device, host_pages, len(hashes), handle, ps)

    def _storage_hits(self, node: RadixNode, tokens: list[int], limit: int) -> tuple[bytes, ...]:
        """Hashes of the pages after `node` that storage holds (leading run)."""
        if self.storage is None or node.end_page >= limit:
            return ()
        ps = self.page_size
        last = self.tree.last_hash(node)
        hashes = chain_hashes(last, tokens[node.end_page * ps : limit * ps], ps)
        try:
            found = self.storage.exists(hashes)
        except Exception:
            log.exception("storage.exists failed; treating as a miss")
            return ()
        return tuple(hashes[: max(0, min(found, len(hashes)))])

    def _on_hit(self, path: list[RadixNode], prompt_tokens: int) -> None:
        """Hit counts drive selective write-through and storage admission."""
        for node in path:
            node.hit_count += 1
        if self.host_pool is None:
            return
        cfg = self.config
        hot: list[RadixNode] = []
        due: list[RadixNode] = []
        if cfg.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            threshold = cfg.write_through_threshold
            hot = [
                n
                for n in path
                if n.device is not None and n.host is None and n.hit_count >= threshold
            ]
        if self.storage is not None and cfg.disk_admit_hits > 0:
            due = [n for n in path if n.host is not None and n.hit_count >= cfg.disk_admit_hits]
        if not hot and not due:
            return
        deepest = path[-1]
        self.tree.lock(deepest)  # the writes below may evict L2: keep this match's nodes
        try:
            if hot:
                self._write_nodes(hot, prompt_tokens)
            if due:
                self._store_nodes(due)
        finally:
            self.tree.unlock(deepest)

    def lock(self, handle: MatchHandle) -> None:
        """Protect the handle's path from eviction (counted; pair with `unlock`)."""
        if not self.tree.is_attached(handle.node):
            raise ValueError("stale handle: its pages were evicted before it was locked")
        self.tree.lock(handle.node)

    def unlock(self, handle: MatchHandle) -> None:
        if not self.tree.is_attached(handle.node):
            raise ValueError("unlock of a handle that holds no lock (its node is gone)")
        self.tree.unlock(handle.node)

    def lookup(self, tokens: Sequence[int], salt: str = "") -> dict[str, int]:
        """Cached tokens of `tokens` per tier, without touching LRU or splitting nodes."""
        tokens = tokens if type(tokens) is list else list(tokens)
        ps = self.page_size
        root = self._root(salt)
        walk = self.tree.walk(tokens, root=root)
        counts = {"device": 0, "host": 0, "storage": 0}
        pairs = [(n, n.num_pages) for n in walk.path]
        if walk.partial is not None:
            pairs.append((walk.partial, walk.partial_pages))
        for node, k in pairs:
            counts["device" if node.device is not None else "host"] += k * ps
        if self.storage is not None:
            node, k = pairs[-1] if pairs else (root, 0)
            end = node.start_page + k if pairs else 0
            last = node.hashes[k - 1] if k else self.tree.last_hash(root)
            rest = tokens[end * ps : (len(tokens) // ps) * ps]
            if rest:
                try:
                    found = self.storage.exists(chain_hashes(last, rest, ps))
                except Exception:
                    log.exception("storage.exists failed during lookup")
                    found = 0
                counts["storage"] = found * ps
        return counts

    # -- requests' private pages --------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` could succeed (free pages plus unlocked cached ones)."""
        if self.device_pool.allocator.can_allocate(n):
            return True
        evictable = sum(
            node.num_pages
            for node in self.tree.iter_nodes()
            if node.device is not None
            and not node.lock_ref
            and (node.host is not None or not node.host_ref)
        )
        return n <= self.device_pool.allocator.num_free + evictable

    def allocate(self, n: int) -> list[int] | None:
        """L1 pages for a running request, evicting unlocked cached pages as needed."""
        pages = self._alloc_device(n)
        if pages is not None:
            self._private.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return request-private pages (not ones the tree owns)."""
        stray = [p for p in pages if p not in self._private]
        if stray:
            raise ValueError(f"pages {stray} are not private to a request (tree-owned or free)")
        self._private.difference_update(pages)
        self.device_pool.allocator.free(pages)

    def _alloc_device(self, n: int) -> list[int] | None:
        alloc = self.device_pool.allocator
        if not alloc.can_allocate(n):
            self._evict_device(n - alloc.num_free, backup=self._write_back)
        return alloc.allocate(n) if alloc.can_allocate(n) else None

    def _alloc_host(self, n: int) -> list[int] | None:
        assert self.host_pool is not None and self.host_pool.allocator is not None
        alloc = self.host_pool.allocator
        if not alloc.can_allocate(n):
            self._evict_host(n - alloc.num_free)
        return alloc.allocate(n) if alloc.can_allocate(n) else None

    def _release_slots(self, slots: Sequence[int]) -> None:
        assert self.host_pool is not None and self.host_pool.allocator is not None
        for s in slots:
            self._slot_state[s] = SlotState.FREE
        self.host_pool.allocator.free(slots)

    # -- insert -------------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], device_pages: Sequence[int], salt: str = ""
    ) -> InsertResult:
        """Hand the full pages of a prompt (and output) to the tree.

        `device_pages[i]` holds page i of `tokens`; each must be private to the
        caller or already the tree's page at that position. Where the tree has
        the tokens already, its page wins and the caller's duplicate is freed.
        Returns a handle locked for the caller and the canonical page list
        (`device_pages` with duplicates replaced; a trailing partial page stays
        the caller's).
        """
        tokens = tokens if type(tokens) is list else list(tokens)
        pages = list(device_pages)
        n = len(tokens) // self.page_size
        if len(pages) < n:
            raise ValueError(f"{len(tokens)} tokens need {n} full pages, got {len(pages)}")
        root = self._root(salt)
        if not self.config.enable_prefix_cache or n == 0:
            return InsertResult(MatchHandle(root), pages)
        full = pages[:n]
        self._check_insertable(tokens, full, root)
        out = self.tree.insert(tokens, full, Tier.DEVICE, start=root)
        self._private.difference_update(out.taken)
        if out.duplicates:
            self._private.difference_update(out.duplicates)
            self.device_pool.allocator.free(out.duplicates)
        self.counters.inserted_pages += len(out.taken)
        node = out.node
        self.tree.touch(node)
        self.tree.lock(node)
        self._write_through(node, len(tokens))
        return InsertResult(MatchHandle(node), out.pages + pages[n:])

    def _check_insertable(self, tokens: list[int], full: list[int], root: RadixNode) -> None:
        if len(set(full)) != len(full):
            raise ValueError("the same device page appears twice in one insert")
        private = self._private
        foreign = [i for i, p in enumerate(full) if p not in private]
        if not foreign:
            return
        walk = self.tree.walk(tokens, foreign[-1] + 1, root)
        tree_pages: list[int] = []
        for node in walk.path:
            tree_pages += node.device or [-1] * node.num_pages
        if walk.partial is not None and walk.partial.device is not None:
            tree_pages += walk.partial.device[: walk.partial_pages]
        for i in foreign:
            if i >= len(tree_pages) or tree_pages[i] != full[i]:
                raise ValueError(
                    f"device page {full[i]} at page {i} is neither private to the caller "
                    f"nor the tree's page for those tokens"
                )

    def _write_through(self, node: RadixNode, prompt_tokens: int) -> None:
        """Start the L1 -> L2 copies the write policy asks for at insert time."""
        if self.host_pool is None or self.config.write_policy == WritePolicy.WRITE_BACK:
            return
        threshold = (
            self.config.write_through_threshold
            if self.config.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE
            else 0
        )
        todo = [
            n
            for n in self.tree.path(node)
            if n.device is not None and n.host is None and n.hit_count >= threshold
        ]
        if todo:
            self._write_nodes(todo, prompt_tokens)

    # -- background L1 -> L2 writes and L2 -> storage stores ----------------------------------

    def _write_nodes(self, nodes: list[RadixNode], prompt_tokens: int) -> None:
        """Copy the L1 pages of `nodes` (all on one path, prefix first) to fresh L2 slots."""
        assert self.host_pool is not None and self.host_pool.tensor is not None
        n = sum(node.num_pages for node in nodes)
        slots = self._alloc_host(n)
        if slots is None:
            self.counters.writes_skipped += n
            return
        src: list[int] = []
        i = 0
        for node in nodes:
            node.host = slots[i : i + node.num_pages]
            src += node.device or []
            i += node.num_pages
        for s in slots:
            self._slot_state[s] = SlotState.WRITING
        deepest = nodes[-1]
        self.tree.lock(deepest)
        admit = self._admit(max(nd.hit_count for nd in nodes), prompt_tokens)
        ticket = self.transfer.submit(self.device_pool.tensor, src, self.host_pool.tensor, slots)
        self._on_transfer[ticket] = partial(self._on_write_done, deepest, slots, admit)

    def _admit(self, hits: int, prompt_tokens: int) -> bool:
        """L2 -> storage admission: hot pages or long prompts (both limits 0: everything)."""
        if self.storage is None:
            return False
        min_hits, min_tokens = self.config.disk_admit_hits, self.config.disk_admit_tokens
        if min_hits == 0 and min_tokens == 0:
            return True
        return (min_hits > 0 and hits >= min_hits) or (
            min_tokens > 0 and prompt_tokens >= min_tokens
        )

    def _nodes_holding(self, deepest: RadixNode, slots: Sequence[int]) -> list[RadixNode]:
        """Nodes on the path to `deepest` whose L2 slots are among `slots`."""
        wanted = set(slots)
        return [n for n in self.tree.path(deepest) if n.host is not None and n.host[0] in wanted]

    def _on_write_done(
        self, deepest: RadixNode, slots: list[int], admit: bool, done: TransferDone
    ) -> None:
        if not done.ok:
            self.counters.transfer_failures += 1
            for node in self._nodes_holding(deepest, slots):
                node.host = None
            self._release_slots(slots)
            self.tree.unlock(deepest)
            return
        for s in slots:
            self._slot_state[s] = SlotState.READY
        self.counters.device_to_host_pages += done.num_pages
        self.counters.device_to_host_bytes += done.num_bytes
        if admit:
            self._store_nodes(self._nodes_holding(deepest, slots))
        self.tree.unlock(deepest)

    def _store_nodes(self, nodes: list[RadixNode]) -> None:
        """Persist the valid, not yet stored L2 pages of `nodes` (one path) below L2."""
        assert self.storage is not None
        ps, refs = self.page_size, []
        for node in nodes:
            parents = [self.tree.last_hash(node.parent), *node.hashes[:-1]]
            for j, s in enumerate(node.host or ()):
                if self._slot_state[s] == SlotState.READY:
                    page_tokens = tuple(node.tokens[j * ps : (j + 1) * ps])
                    refs.append(PageRef(node.hashes[j], page_tokens, s, parents[j]))
        if not refs:
            return
        slots = [r.slot for r in refs]
        for s in slots:
            self._slot_state[s] = SlotState.STORING
        deepest = nodes[-1]
        self.tree.hold_host(deepest)
        try:
            ticket = self.storage.submit_store(refs)
        except Exception:
            log.exception("storage.submit_store failed")
            self.counters.store_failures += 1
            for s in slots:
                self._slot_state[s] = SlotState.READY
            self.tree.release_host(deepest)
            return
        self._on_storage[ticket] = partial(self._on_store_done, deepest, slots)

    def _on_store_done(self, deepest: RadixNode, slots: list[int], c: Completion) -> None:
        stored = c.error is None and c.pages_ok >= len(slots)
        if not stored:
            self.counters.store_failures += 1
            log.warning("store of %d pages: %d persisted (%s)", len(slots), c.pages_ok, c.error)
        for s in slots:
            self._slot_state[s] = SlotState.STORED if stored else SlotState.READY
        self.counters.host_to_storage_pages += c.pages_ok
        self.counters.host_to_storage_bytes += c.pages_ok * self.layout.page_bytes
        self.tree.release_host(deepest)

    # -- loads: L3/L4 -> L2 -> L1 -------------------------------------------------------------

    def load(self, match: MatchResult) -> LoadTicket | None:
        """Start bringing the host (and storage) part of `match` into L1; None if nothing to do.

        The pages stay protected while they move. The caller's own lock on
        `match.handle` (if any) is untouched; the finished ticket carries a new
        lock on the L1 prefix.
        """
        if not self.tree.is_attached(match.handle.node):
            raise ValueError("stale match: its pages were evicted; match again")
        path = self.tree.path(match.handle.node)
        first_host = next((i for i, n in enumerate(path) if n.device is None), len(path))
        host_nodes = path[first_host:]
        n_host = sum(n.num_pages for n in host_nodes)
        hashes = match.handle.storage_hashes if self.storage is not None else ()
        if n_host + len(hashes) == 0:
            return None
        anchor = match.handle.node  # the path's last node, or the (salt's) root
        prefix = sum(n.num_pages for n in path[:first_host])
        ticket = LoadTicket(next(self._load_ids), n_host, len(hashes))
        job = _Load(ticket, anchor, anchor, prefix + n_host + len(hashes), match.handle.tokens)
        self.tree.lock(anchor)
        job.locked.append(anchor)
        pages = self._alloc_device(n_host + len(hashes))
        if pages is None and hashes:
            job.errors.append("no L1 room for the storage pages")
            hashes = ()
            pages = self._alloc_device(n_host)
        if pages is None:
            job.errors.append("no free L1 pages for the load")
            self._finish_load(job)
            return ticket
        self._inflight_device.update(pages)
        if host_nodes:
            job.parts += 1
            self._submit_fill(job, anchor, host_nodes[0].start_page, pages[:n_host])
        if hashes:
            job.spare = pages[n_host:]
            self._submit_storage_load(job, hashes)
        if job.parts == 0:
            self._finish_load(job)
        return ticket

    def _submit_fill(
        self, job: _Load, deepest: RadixNode, start: int, pages: list[int | None]
    ) -> None:
        """Copy L2 -> L1 for nodes from page `start` to `deepest`; `pages[i]` is page start+i's
        destination, None for nodes already on L1."""
        assert self.host_pool is not None and self.host_pool.tensor is not None
        src: list[int] = []
        dst: list[int] = []
        for node in self.tree.path(deepest):
            if node.start_page < start:
                continue
            seg = pages[node.start_page - start : node.end_page - start]
            if seg and seg[0] is not None:
                src += node.host or []
                dst += seg  # type: ignore[arg-type]
        ticket = self.transfer.submit(self.host_pool.tensor, src, self.device_pool.tensor, dst)
        self._on_transfer[ticket] = partial(self._on_fill_done, job, deepest, start, pages)

    def _on_fill_done(
        self,
        job: _Load,
        deepest: RadixNode,
        start: int,
        pages: list[int | None],
        done: TransferDone,
    ) -> None:
        if not done.ok:
            self.counters.transfer_failures += 1
            job.errors.append(f"L2 -> L1 copy failed: {done.error}")
        else:
            self.counters.host_to_device_pages += done.num_pages
            self.counters.host_to_device_bytes += done.num_bytes
        unused: list[int] = []
        for node in self.tree.path(deepest):
            if node.start_page < start:
                continue
            seg = pages[node.start_page - start : node.end_page - start]
            if not seg or seg[0] is None:
                continue
            parent_on_l1 = node.parent.is_root or node.parent.device is not None
            if done.ok and node.device is None and parent_on_l1:
                node.device = seg  # type: ignore[assignment]
            else:
                unused += seg  # type: ignore[arg-type]
            self._inflight_device.difference_update(seg)  # type: ignore[arg-type]
        if unused:
            self.device_pool.allocator.free(unused)
        self._part_done(job)

    def _submit_storage_load(self, job: _Load, hashes: tuple[bytes, ...]) -> None:
        assert self.storage is not None
        slots = self._alloc_host(len(hashes))
        if slots is None:
            job.errors.append("no L2 room for the storage pages")
            self._drop_spare(job)
            return
        for s in slots:
            self._slot_state[s] = SlotState.LOADING
        self._inflight_host.update(slots)
        job.parts += 1
        try:
            ticket = self.storage.submit_load(list(hashes), slots)
        except Exception as exc:
            log.exception("storage.submit_load failed")
            fail = Completion(-1, TicketKind.LOAD, 0, len(hashes), f"{type(exc).__name__}: {exc}")
            self._on_storage_loaded(job, slots, fail)
            return
        self._on_storage[ticket] = partial(self._on_storage_loaded, job, slots)

    def _drop_spare(self, job: _Load) -> None:
        if job.spare:
            self._inflight_device.difference_update(job.spare)
            self.device_pool.allocator.free(job.spare)
            job.spare = []

    def _on_storage_loaded(self, job: _Load, slots: list[int], c: Completion) -> None:
        k = max(0, min(c.pages_ok, len(slots)))
        job.ticket.pages_from_remote += min(c.pages_from_remote, k)
        if c.error is not None or k < len(slots):
            job.errors.append(f"storage delivered {k} of {len(slots)} pages: {c.error}")
        self._inflight_host.difference_update(slots)
        if k < len(slots):
            self._release_slots(slots[k:])
        self.counters.storage_to_host_pages += k
        self.counters.storage_to_host_bytes += k * self.layout.page_bytes
        if k == 0 or not self.tree.is_attached(job.anchor):
            if k:
                self._release_slots(slots[:k])
            self._drop_spare(job)
            self._part_done(job)
            return
        for s in slots[:k]:
            self._slot_state[s] = SlotState.READY
        out = self.tree.insert(job.tokens, slots[:k], Tier.HOST, start=job.anchor)
        if out.duplicates:
            self._release_slots(out.duplicates)
        self.tree.lock(out.node)
        job.locked.append(out.node)
        job.final = out.node
        self._fill_from_storage(job, out.node)

    def _fill_from_storage(self, job: _Load, deepest: RadixNode) -> None:
        """Give the freshly read pages L1 pages from the load's spare ones and copy them up."""
        start = job.anchor.end_page
        spare = iter(job.spare)
        used: list[int] = []
        pages: list[int | None] = []
        for node in self.tree.path(deepest):
            if node.start_page < start:
                continue
            if node.device is not None:
                pages += [None] * node.num_pages
            else:
                seg = [next(spare) for _ in range(node.num_pages)]
                pages += seg
                used += seg
        taken = set(used)
        job.spare = [p for p in job.spare if p not in taken]
        self._drop_spare(job)
        self._submit_fill(job, deepest, start, pages)

    def _part_done(self, job: _Load) -> None:
        job.parts -= 1
        if job.parts == 0:
            self._finish_load(job)

    def _finish_load(self, job: _Load) -> None:
        self._drop_spare(job)
        device: list[int] = []
        last = self.tree.root_of(job.anchor)
        if self.tree.is_attached(job.final):
            for node in self.tree.path(job.final):
                if node.device is None:
                    break
                device += node.device
                last = node
        self.tree.lock(last)
        for node in job.locked:
            self.tree.unlock(node)
        t = job.ticket
        # Report what reached L1, not what was asked for: a short load is partly recomputed.
        already = job.expected_pages - t.pages_from_host - t.pages_from_storage  # L1 before
        arrived = max(0, len(device) - already)
        t.pages_from_host = min(t.pages_from_host, arrived)
        t.pages_from_storage = min(t.pages_from_storage, arrived - t.pages_from_host)
        t.pages_from_remote = min(t.pages_from_remote, t.pages_from_storage)
        t.done = True
        t.device_pages = device
        t.handle = MatchHandle(last)
        if len(device) < job.expected_pages and not job.errors:
            job.errors.append(f"{len(device)} of {job.expected_pages} pages reached L1")
        t.ok = not job.errors
        t.error = "; ".join(job.errors) or None
        t.elapsed_s = time.monotonic() - job.started
        if not t.ok:
            self.counters.load_failures += 1
        if not last.is_root:
            self.tree.touch(last)
        self._finished_loads.append(t)

    # -- poll -----------------------------------------------------------------------------------

    def poll(self) -> list[LoadTicket]:
        """Complete finished copies and storage operations; returns loads that finished."""
        for done in self.transfer.poll():
            self._dispatch(self._on_transfer.pop(done.ticket, None), done)
        if self.storage is not None:
            try:
                completions = self.storage.poll()
            except Exception:
                log.exception("storage.poll failed")
                completions = []
            for c in completions:
                if isinstance(c, Settled):
                    continue  # quarantine is not tracked yet (issue 11)
                self._dispatch(self._on_storage.pop(c.ticket, None), c)
        out, self._finished_loads = self._finished_loads, []
        return out

    def _dispatch(self, callback: Callable | None, result: object) -> None:
        if callback is None:
            log.warning("completion for an unknown ticket: %s", result)
            return
        try:
            callback(result)
        except Exception:
            # A broken completion must not stop the others; it is counted and logged.
            log.exception("cache completion handler failed for %s", result)
            self.counters.transfer_failures += 1

    def drain(self, timeout_s: float = 30.0) -> list[LoadTicket]:
        """Block until no background work is left (tests and shutdown only)."""
        deadline = time.monotonic() + timeout_s
        out = self.poll()
        while self.pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pending} cache operations still pending")
            time.sleep(0.0005)
            out += self.poll()
        return out

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, n_pages: int) -> int:
        """Free at least `n_pages` L1 pages from unlocked cached ones; returns pages freed."""
        return self._evict_device(n_pages, backup=self._write_back)

    def evict_host(self, n_pages: int) -> int:
        """Free at least `n_pages` L2 slots; returns slots freed."""
        return self._evict_host(n_pages) if self.host_pool is not None else 0

    def _evict_device(self, n_pages: int, backup: bool) -> int:
        freed = 0
        if n_pages <= 0:
            return 0
        for node in self.tree.evictable(Tier.DEVICE):
            if freed >= n_pages:
                break
            need = n_pages - freed
            if node.num_pages > need:
                self.tree.split(node, node.num_pages - need)  # `node` keeps the suffix
            freed += self._drop_device(node, backup)
        return freed

    def _drop_device(self, node: RadixNode, backup: bool) -> int:
        pages = node.device
        assert pages is not None
        if node.host is None and backup:
            self._backup(node)
        node.device = None
        self.device_pool.allocator.free(pages)
        self.counters.device_evicted_pages += len(pages)
        if node.host is None:
            self._remove(node)
        return len(pages)

    def _backup(self, node: RadixNode) -> None:
        """Write-back: copy an evicted L1 run to L2 now (the eviction needs the page back)."""
        assert self.host_pool is not None and self.host_pool.tensor is not None
        slots = self._alloc_host(node.num_pages)
        if slots is None:
            self.counters.writes_skipped += node.num_pages
            return
        ticket = self.transfer.submit(
            self.device_pool.tensor, node.device or [], self.host_pool.tensor, slots
        )
        done = self.transfer.wait(ticket)
        if not done.ok:
            self.counters.transfer_failures += 1
            self._release_slots(slots)
            return
        node.host = slots
        for s in slots:
            self._slot_state[s] = SlotState.READY
        self.counters.device_to_host_pages += done.num_pages
        self.counters.device_to_host_bytes += done.num_bytes
        if self._admit(node.hit_count, node.end_page * self.page_size):
            self._store_nodes([node])

    def _evict_host(self, n_pages: int) -> int:
        freed = 0
        if n_pages <= 0:
            return 0
        # Runs only in L2 go before L2 backups of runs still in L1.
        order = self.tree.evictable(
            Tier.HOST, lambda n: (n.device is not None, n.last_access, -n.end_page)
        )
        for node in order:
            if freed >= n_pages:
                break
            need = n_pages - freed
            if node.num_pages > need:
                self.tree.split(node, node.num_pages - need)
            slots = node.host or []
            node.host = None
            self._release_slots(slots)
            self.counters.host_evicted_pages += len(slots)
            freed += len(slots)
            if node.device is None:
                self._remove(node)
        return freed

    def _remove(self, node: RadixNode) -> None:
        """Drop a node that lives nowhere, with its subtree (dead without their prefix)."""
        for n in self.tree.remove_subtree(node):
            if n.host is not None:
                self._release_slots(n.host)
                self.counters.host_evicted_pages += len(n.host)
                n.host = None
            if n.device is not None:
                self.device_pool.allocator.free(n.device)
                self.counters.device_evicted_pages += len(n.device)
                n.device = None

    def clear(self) -> int:
        """Drop every unlocked cached page in L1 and L2; returns pages dropped."""
        dropped = self._evict_device(self.device_pool.num_pages, backup=False)
        if self.host_pool is not None:
            dropped += self._evict_host(self.host_pool.num_slots)
        return dropped

    # -- stats, integrity, shutdown ---------------------------------------------------------

    def stats(self) -> CacheStats:
        dev_cached = host_cached = 0
        for node in self.tree.iter_nodes():
            dev_cached += len(node.device or ())
            host_cached += len(node.host or ())
        alloc = self.device_pool.allocator
        device = Occupancy(
            alloc.num_total,
            alloc.num_free,
            dev_cached,
            len(self._private) + len(self._inflight_device),
        )
        host = None
        if self.host_pool is not None and self.host_pool.allocator is not None:
            h = self.host_pool.allocator
            host = Occupancy(h.num_total, h.num_free, host_cached, len(self._inflight_host))
        return CacheStats(
            counters=replace(self.counters),
            device=device,
            host=host,
            page_bytes=self.layout.page_bytes,
            pending_transfers=len(self._on_transfer),
            pending_storage=len(self._on_storage),
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError describing every inconsistency found."""
        problems: list[str] = []
        dev_owned: dict[int, str] = {}
        host_owned: dict[int, str] = {}
        for node in self.tree.iter_nodes():
            problems += self._check_node(node, dev_owned, host_owned)
        problems += self._check_device_pool(dev_owned)
        if self.host_pool is not None:
            problems += self._check_host_pool(host_owned)
        if problems:
            raise IntegrityError("; ".join(problems[:20]))

    def _check_node(
        self, node: RadixNode, dev_owned: dict[int, str], host_owned: dict[int, str]
    ) -> list[str]:
        ps, out = self.page_size, []
        parent = node.parent
        where = f"node pages {node.start_page}..{node.end_page}"
        if parent is None or parent.children.get(tuple(node.tokens[:ps])) is not node:
            return [f"{where}: not linked from its parent under its first page"]
        if node.num_pages == 0 or len(node.tokens) != node.num_pages * ps:
            out.append(f"{where}: {len(node.tokens)} tokens for {node.num_pages} pages")
        if node.start_page != parent.end_page:
            out.append(f"{where}: starts at {node.start_page}, parent ends at {parent.end_page}")
        last = self.tree.last_hash(parent)
        if chain_hashes(last, node.tokens, ps) != node.hashes:
            out.append(f"{where}: page hashes are not the chain of its tokens")
        for name in ("lock_ref", "host_ref"):
            mine = getattr(node, name)
            below = sum(getattr(c, name) for c in node.children.values())
            if mine < 0:
                out.append(f"{where}: negative {name} {mine}")
            if mine < below:
                out.append(f"{where}: {name} {mine} below its children's {below}")
        if node.device is None and node.host is None:
            out.append(f"{where}: lives in no tier")
        if node.device is not None and not parent.is_root and parent.device is None:
            out.append(f"{where}: on L1 but its parent is not")
        for tier, owned in ((node.device, dev_owned), (node.host, host_owned)):
            if tier is None:
                continue
            if len(tier) != node.num_pages:
                out.append(f"{where}: {len(tier)} pages listed for {node.num_pages}")
            for p in tier:
                if p in owned:
                    out.append(f"page/slot {p} owned by {where} and by {owned[p]}")
                owned[p] = where
        for s in node.host or ():
            state = self._slot_state[s]
            busy = state in (SlotState.WRITING, SlotState.STORING)
            if state not in VALID_SLOT_STATES and not busy:
                out.append(f"{where}: slot {s} in state {state.name}")
            if state == SlotState.WRITING and node.lock_ref == 0:
                out.append(f"{where}: slot {s} WRITING but the node is unlocked")
            if state == SlotState.STORING and node.host_ref == 0:
                out.append(f"{where}: slot {s} STORING but its L2 copy is not held")
            if node.device is None and state == SlotState.WRITING:
                out.append(f"{where}: only copy in slot {s} is still being written")
        return out

    def _check_device_pool(self, owned: dict[int, str]) -> list[str]:
        alloc = self.device_pool.allocator
        groups = {
            "free": set(alloc.free_pages()),
            "cached": set(owned),
            "private": self._private,
            "loading": self._inflight_device,
        }
        return _partition_problems("L1", alloc.num_total, groups)

    def _check_host_pool(self, owned: dict[int, str]) -> list[str]:
        assert self.host_pool is not None and self.host_pool.allocator is not None
        alloc = self.host_pool.allocator
        free = set(alloc.free_pages())
        groups = {"free": free, "cached": set(owned), "loading": self._inflight_host}
        out = _partition_problems("L2", alloc.num_total, groups)
        for s in free:
            if self._slot_state[s] != SlotState.FREE:
                out.append(f"L2 free slot {s} in state {self._slot_state[s].name}")
        for s in self._inflight_host:
            if self._slot_state[s] != SlotState.LOADING:
                out.append(f"L2 loading slot {s} in state {self._slot_state[s].name}")
        return out

    def close(self) -> None:
        """Finish copies in flight, then release the pools (the storage tier is the caller's)."""
        self.transfer.close()
        if self.host_pool is not None and self._owns_host_pool:
            self.host_pool.close()


def _partition_problems(pool: str, total: int, groups: dict[str, set[int]]) -> list[str]:
    """free + cached + in use == total, each page in exactly one group."""
    out = []
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = groups[a] & groups[b]
            if both:
                out.append(f"{pool} pages both {a} and {b}: {sorted(both)[:8]}")
    union = set().union(*groups.values())
    if len(union) != total or any(not 0 <= p < total for p in union):
        missing = sorted(set(range(total)) - union)[:8]
        out.append(f"{pool}: {len(union)} pages accounted of {total} (missing e.g. {missing})")
    sizes = ", ".join(f"{k} {len(v)}" for k, v in groups.items())
    if sum(len(v) for v in groups.values()) != total:
        out.append(f"{pool}: {sizes} do not add up to {total}")
    return out
