"""`clear_tiers`: empty L1 and/or L2 of every cached page that may go, and say what stayed.

A clear visits the tree's nodes children first (one `cache_salt`'s root, or
all of them) and drops a node's copy in each tier asked for, unless:

* it is in use: locked by a running request or a load (`lock_ref`), its L2
  copy held by a store (`host_ref`), or its L2 slots are being written, stored
  or quarantined (the ledger allows READY and STORED slots to be freed only);
* it is pinned (cache.pins), unless `include_pinned`: L2 keeps it, and L1 keeps
  it only when L2 has no valid copy (L1 may drop a pinned page L2 holds);
* dropping it would break the tree's rules: an L1 copy whose child keeps its
  own (L1 residency is prefix-closed), a node with children left that would
  live nowhere.

A node that lives nowhere afterwards leaves the tree. The counts come from the
ledgers (pages that left the tier) and from the visit (pages kept, and why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asynchicache.hierarchy.eviction import EVICTABLE_SLOTS, Evictor
from asynchicache.hierarchy.l2.ledger import TREE_SLOT_STATES, PageState, SlotState
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.parts import CacheParts


@dataclass
class ClearedTier:
    """One tier's part of a clear: pages dropped, pages kept because in use or pinned."""

    removed: int = 0
    kept_in_use: int = 0
    kept_pinned: int = 0


@dataclass
class CacheClear:
    """What a clear of L1/L2 did, per tier asked for (`device`, `host`)."""

    tiers: dict[str, ClearedTier] = field(default_factory=dict)

    @property
    def removed(self) -> int:
        return sum(t.removed for t in self.tiers.values())


class _Visit:
    """One clear: the tiers asked for, the pin rule, and the tallies."""

    def __init__(
        self, parts: CacheParts, evictor: Evictor, device: bool, host: bool, include_pinned: bool
    ) -> None:
        self.parts = parts
        self.evictor = evictor
        self.device = device
        self.host = host and parts.host_pool is not None
        self.include_pinned = include_pinned
        self.kept = {"device": ClearedTier(), "host": ClearedTier()}

    def node(self, node: RadixNode) -> None:
        """Clear one node (its children done already); a partly pinned one is split first."""
        if node.parent is None:  # left the tree with an ancestor meanwhile
            return
        k = 0 if self.include_pinned else self.parts.pins.leading(node.hashes)
        if 0 < k < node.num_pages:
            mid = self.parts.tree.split(node, k)  # `node` keeps the unpinned suffix
            self._clear(node, pinned=False)
            self._clear(mid, pinned=True)
            return
        self._clear(node, pinned=k > 0)

    def _clear(self, node: RadixNode, pinned: bool) -> None:
        if self.device and node.device is not None:
            self._device(node, pinned)
        if node.parent is not None and self.host and node.host is not None:
            self._host(node, pinned)

    def _device(self, node: RadixNode, pinned: bool) -> None:
        tally = self.kept["device"]
        n = node.num_pages
        in_use = node.lock_ref > 0 or (node.host_ref > 0 and node.host is None)
        child_kept = any(c.device is not None for c in node.children.values())
        if in_use or child_kept:
            tally.kept_in_use += n
        elif pinned and not self._valid_in_host(node):
            tally.kept_pinned += n
        else:
            self.evictor.drop_device(node, backup=False)

    def _host(self, node: RadixNode, pinned: bool) -> None:
        tally = self.kept["host"]
        n = node.num_pages
        slots = node.host or []
        busy = any(self.parts.host.state(s) not in EVICTABLE_SLOTS for s in slots)
        orphaning = node.device is None and bool(node.children)  # a child kept its copy
        if node.lock_ref or node.host_ref or busy:
            tally.kept_in_use += n
        elif pinned:
            tally.kept_pinned += n
        elif orphaning:
            tally.kept_in_use += n
        else:
            node.host = None
            self.parts.host.move(slots, EVICTABLE_SLOTS, SlotState.FREE)
            self.parts.counters.host_evicted_pages += len(slots)
            if node.device is None:
                self.evictor.remove(node)

    def _valid_in_host(self, node: RadixNode) -> bool:
        ledger = self.parts.host
        return node.host is not None and all(
            ledger.state(s) != SlotState.WRITING for s in node.host
        )


def clear_tiers(
    parts: CacheParts,
    evictor: Evictor,
    roots: list[RadixNode],
    device: bool = True,
    host: bool = True,
    include_pinned: bool = False,
) -> CacheClear:
    """Drop the cached pages under `roots` from L1 (`device`) and/or L2 (`host`)."""
    dev_before = parts.device.count(PageState.CACHED)
    host_before = parts.host.count(*TREE_SLOT_STATES)
    visit = _Visit(parts, evictor, device, host, include_pinned)
    for root in roots:
        order = list(parts.tree.iter_subtree(root))
        for node in reversed(order):  # children before their parent
            visit.node(node)
    out = CacheClear()
    if device:
        visit.kept["device"].removed = dev_before - parts.device.count(PageState.CACHED)
        out.tiers["device"] = visit.kept["device"]
    if host:
        visit.kept["host"].removed = host_before - parts.host.count(*TREE_SLOT_STATES)
        out.tiers["host"] = visit.kept["host"]
    return out
