"""`Evictor`: room in L1 and L2, made by dropping unlocked cached pages, suffixes first.

Allocation asks the ledger for the lowest free pages and evicts first when
too few are free. Only pages and slots in states no asynchronous work touches
are dropped: eviction picks unlocked, unheld tree leaves (`RadixTree.evictable`),
L2 eviction skips pinned pages (cache.pins; L1 may drop them, L2 keeps them),
and the ledger refuses anything else (an L2 slot leaves the tree for FREE only
from READY or STORED).
"""

from __future__ import annotations

from collections.abc import Callable

from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.l2.ledger import PageState, SlotState
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.parts import CacheParts
from asynchicache.settings.config import WritePolicy

EVICTABLE_SLOTS = (SlotState.READY, SlotState.STORED)


class Evictor:
    """Allocates L1 pages and L2 slots, evicting unlocked cached ones when needed."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts
        # Write-back copies a run to L2 as it leaves L1 (set by the hierarchy to its Writer).
        self.backup: Callable[[RadixNode], None] | None = None

    @property
    def write_back(self) -> bool:
        p = self.parts
        return p.host_pool is not None and p.config.write_policy == WritePolicy.WRITE_BACK

    def alloc_device(self, n: int, state: PageState) -> list[int] | None:
        ledger = self.parts.device
        if ledger.num_free < n:
            self.evict_device(n - ledger.num_free, backup=self.write_back)
        return ledger.take(n, state)

    def alloc_host(self, n: int, state: SlotState) -> list[int] | None:
        ledger = self.parts.host
        if ledger.num_free < n:
            self.evict_host(n - ledger.num_free)
        return ledger.take(n, state)

    def alloc_host_upto(self, n: int, state: SlotState) -> list[int]:
        """As many of `n` L2 slots as eviction can free (a load reads the prefix of its
        chain that fits rather than nothing)."""
        ledger = self.parts.host
        if ledger.num_free < n:
            self.evict_host(n - ledger.num_free)
        return ledger.take(min(n, ledger.num_free), state) or []

    def can_allocate(self, n: int) -> bool:
        """Whether `n` L1 pages could be had (free plus unlocked cached ones)."""
        return n <= self.parts.device.num_free or n <= self.available_pages()

    def available_pages(self) -> int:
        """Free L1 pages plus cached ones no lock or L2-less hold protects."""
        evictable = sum(
            node.num_pages
            for node in self.parts.tree.iter_tier(Tier.DEVICE)
            if not node.lock_ref and (node.host is not None or not node.host_ref)
        )
        return self.parts.device.num_free + evictable

    def evict_device(self, n_pages: int, backup: bool) -> int:
        """Free at least `n_pages` L1 pages from unlocked cached runs; returns pages freed."""
        freed = 0
        if n_pages <= 0:
            return 0
        tree = self.parts.tree
        for node in tree.evictable(Tier.DEVICE):
            if freed >= n_pages:
                break
            need = n_pages - freed
            if node.num_pages > need:
                tree.split(node, node.num_pages - need)  # `node` keeps the suffix
            freed += self.drop_device(node, backup)
        return freed

    def drop_device(self, node: RadixNode, backup: bool) -> int:
        pages = node.device
        assert pages is not None
        if node.host is None and backup and self.backup is not None:
            self.backup(node)
        node.device = None
        self.parts.device.move(pages, PageState.CACHED, PageState.FREE)
        self.parts.counters.device_evicted_pages += len(pages)
        if node.host is None:
            self.remove(node)
        return len(pages)

    def evict_host(self, n_pages: int) -> int:
        """Free at least `n_pages` L2 slots; returns slots freed."""
        freed = 0
        if n_pages <= 0 or self.parts.host_pool is None:
            return 0
        tree = self.parts.tree
        # Runs only in L2 go before L2 backups of runs still in L1.
        order = tree.evictable(
            Tier.HOST, lambda n: (n.device is not None, n.last_access, -n.end_page)
        )
        for leaf in order:
            if freed >= n_pages:
                break
            node = self._unpinned_part(leaf)
            if node is None:
                continue
            need = n_pages - freed
            if node.num_pages > need:
                tree.split(node, node.num_pages - need)
            slots = node.host or []
            node.host = None
            self.parts.host.move(slots, EVICTABLE_SLOTS, SlotState.FREE)
            self.parts.counters.host_evicted_pages += len(slots)
            freed += len(slots)
            if node.device is None:
                self.remove(node)
        return freed

    def _unpinned_part(self, node: RadixNode) -> RadixNode | None:
        """The part of an L2 leaf that may be evicted: none when all of it is pinned, its
        unpinned suffix (split off) when its leading pages are (pins are prefix chains)."""
        k = self.parts.pins.leading(node.hashes)
        if k == 0:
            return node
        if k >= node.num_pages:
            return None
        self.parts.tree.split(node, k)  # `node` keeps the unpinned suffix
        return node

    def remove(self, node: RadixNode) -> None:
        """Drop a node that lives nowhere, with its subtree (dead without their prefix)."""
        p = self.parts
        for n in p.tree.remove_subtree(node):
            if n.host is not None:
                p.host.move(n.host, EVICTABLE_SLOTS, SlotState.FREE)
                p.counters.host_evicted_pages += len(n.host)
                n.host = None
            if n.device is not None:
                p.device.move(n.device, PageState.CACHED, PageState.FREE)
                p.counters.device_evicted_pages += len(n.device)
                n.device = None
