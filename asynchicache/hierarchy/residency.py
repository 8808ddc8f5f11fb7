"""`Residency`: what L1 and L2 hold, as KV events (pages stored in / removed from a tier).

The events are the storage tiers' (asynchicache.common.tiers: `BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) with the tiers `device` and `host`, so the
engine publishes one stream for L1 to L4.

Rather than a hook at each of the many places that change a node's residency
(inserts, fills, write-throughs, evictions, splits, clears...), `changes()`
compares what the tree holds now with what it reported last time. That is
exact by construction (a subscriber that applies the events holds what the
tree holds, whatever code path changed it) and costs a walk of the tree, taken
only when a ledger changed since the last one (`PoolLedger.changes`). A page
counts in `host` once its L2 bytes are valid (not while WRITING), in `device`
while a tree node lists its L1 page.
"""

from __future__ import annotations

from collections.abc import Iterator

from asynchicache.common.tiers import AllBlocksCleared, BlockRemoved, BlockStored, Tier, TierEvent
from asynchicache.hierarchy.l2.ledger import PoolLedger, SlotState
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.radix import RadixTree

DEVICE = Tier.DEVICE.value
HOST = Tier.HOST.value
TREE_TIERS = (DEVICE, HOST)  # the tiers this process's tree holds


class Residency:
    """Reports the changes of L1/L2 contents since the last call (scheduler thread only)."""

    def __init__(self, tree: RadixTree, device: PoolLedger, host: PoolLedger) -> None:
        self.tree = tree
        self.device = device
        self.host = host
        self._seen: dict[str, set[bytes]] = {t: set() for t in TREE_TIERS}
        self._version = (-1, -1)

    @property
    def changed(self) -> bool:
        """Whether a ledger changed since the last `changes()` (a walk may find something)."""
        return (self.device.changes, self.host.changes) != self._version

    def counts(self) -> dict[str, int]:
        """Pages per tier as last reported."""
        return {t: len(s) for t, s in self._seen.items()}

    def pages(self) -> set[bytes]:
        """Every page of L1 and L2 as last reported."""
        return set().union(*self._seen.values())

    def changes(self) -> list[TierEvent]:
        """Events that turn the last report into the tree's contents now (removals first)."""
        if not self.changed:
            return []
        self._version = (self.device.changes, self.host.changes)
        now: dict[str, set[bytes]] = {t: set() for t in TREE_TIERS}
        stored: list[TierEvent] = []
        for tier, node, pages in self._resident():
            now[tier].update(node.hashes[i] for i in pages)
            new = [i for i in pages if node.hashes[i] not in self._seen[tier]]
            stored += _runs(self.tree, tier, node, new)
        removed: list[TierEvent] = [
            BlockRemoved(t, tuple(sorted(self._seen[t] - now[t]))) for t in TREE_TIERS
            if self._seen[t] - now[t]
        ]  # fmt: skip
        self._seen = now
        return removed + stored

    def snapshot(self) -> list[TierEvent]:
        """The contents as last reported, as events from empty tiers (a late subscriber's
        replay): call right after `changes()` so both agree."""
        events: list[TierEvent] = [AllBlocksCleared(t) for t in TREE_TIERS]
        for tier, node, pages in self._resident():
            events += _runs(
                self.tree, tier, node, [i for i in pages if node.hashes[i] in self._seen[tier]]
            )
        return events

    def _resident(self) -> Iterator[tuple[str, RadixNode, list[int]]]:
        """(tier, node, indices of its pages in that tier), parents before children."""
        for node in self.tree.iter_nodes():
            if node.device is not None:
                yield DEVICE, node, list(range(node.num_pages))
            if node.host is not None:
                valid = [i for i, s in enumerate(node.host)
                         if self.host.state(s) != SlotState.WRITING]  # fmt: skip
                if valid:
                    yield HOST, node, valid


def _runs(tree: RadixTree, tier: str, node: RadixNode, pages: list[int]) -> list[TierEvent]:
    """`BlockStored` per run of consecutive pages of `node` (their parent, their tokens)."""
    out: list[TierEvent] = []
    ps = tree.page_size
    start = 0
    while start < len(pages):
        end = start + 1
        while end < len(pages) and pages[end] == pages[end - 1] + 1:
            end += 1
        first, last = pages[start], pages[end - 1]
        assert node.parent is not None  # iter_nodes never yields a root
        parent = node.hashes[first - 1] if first else tree.last_hash(node.parent)
        tokens = tuple(node.tokens[first * ps : (last + 1) * ps])
        out.append(BlockStored(tier, tuple(node.hashes[first : last + 1]), parent, tokens))
        start = end
    return out
