"""The radix tree over token pages.

A node (node.py) holds a run of whole pages; residency is uniform within a
node: a run that is only partly in a tier is split first.

Children are keyed by the tokens of their first page (a tuple), so a lookup
costs one dict probe and one list-slice comparison per node, never per-token
Python work. Hashes are computed once, for new pages, when they are inserted.

Splitting keeps the existing node object as the *suffix* and inserts a new
parent for the prefix. Anything that refers to a node (a lock handle, an
in-flight copy) therefore keeps referring to the same token path.

Locks count along the path: locking a node increments it and every ancestor,
so `lock_ref` of a node is the number of live locks at or below it. A lock
protects everything (L1 pages, L2 slots, the node itself). `host_ref` counts the
same way but protects only the L2 copy: a node held that way may still lose its
L1 copy when it keeps its L2 one (a slow store to disk must not pin L1).
Both counts reach the root too, so a root's counts are those of its whole tree.

Roots: one per `cache_salt` (the unsalted root is permanent). A salted root
lives while it holds pages or is locked: it is dropped when its last child is
removed unlocked, and a root made only to look (a match or lookup that cached
nothing) is dropped by the next `drop_idle_roots()` (the cache calls it once per
step). So a client cycling salts costs memory only for salts that hold pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asynchicache.common.keys import chain_hashes
from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.node import RadixNode


@dataclass(frozen=True)
class InsertOutcome:
    """What `RadixTree.insert` did.

    `pages` is the canonical per-page list for the inserted run (the tree's own
    pages where it had them); `duplicates` are caller pages the tree did not
    take because it already had the same tokens; `taken` are caller pages the
    tree now owns.
    """

    node: RadixNode
    pages: list[int]
    duplicates: list[int]
    taken: list[int]
    new_node: RadixNode | None


@dataclass(frozen=True)
class Walk:
    """Nodes whose runs fully match a token list, then a partially matched node."""

    path: list[RadixNode]
    partial: RadixNode | None
    partial_pages: int

    @property
    def runs(self) -> list[tuple[RadixNode, int]]:
        """(node, matched pages) along the walk, the partial node last."""
        runs = [(n, n.num_pages) for n in self.path]
        if self.partial is not None:
            runs.append((self.partial, self.partial_pages))
        return runs


class RadixTree:
    """Pages of token prefixes, with per-tier residency, locks and LRU clock."""

    def __init__(self, page_size: int, root_hash: bytes) -> None:
        self.page_size = page_size
        self.root_hash = root_hash
        self.root = RadixNode(None, [], [], 0)
        # One root per cache_salt: tenants never share a path, and their page
        # hashes chain from different namespace digests.
        self._roots: dict[str, RadixNode] = {"": self.root}
        self._root_hashes: dict[RadixNode, bytes] = {self.root: root_hash}
        self._salts: dict[RadixNode, str] = {self.root: ""}
        self._idle: set[RadixNode] = set()  # salted roots that may hold nothing now
        self._clock = 0

    def root_for(self, salt: str, root_hash: Callable[[], bytes]) -> RadixNode:
        """The root of `salt`'s tree (made on first use with `root_hash()`)."""
        root = self._roots.get(salt)
        if root is None:
            root = RadixNode(None, [], [], 0)
            self._roots[salt] = root
            self._root_hashes[root] = root_hash()
            self._salts[root] = salt
            self._idle.add(root)
        return root

    def drop_idle_roots(self) -> int:
        """Drop the salted roots that hold no page and no lock; how many went."""
        idle, self._idle = self._idle, set()
        return sum(self._drop_if_idle(root) for root in idle)

    def _drop_if_idle(self, root: RadixNode) -> bool:
        if root is self.root or root.children or root.lock_ref or root.host_ref:
            return False
        salt = self._salts.pop(root, None)
        if salt is None:  # dropped already
            return False
        del self._roots[salt]
        del self._root_hashes[root]
        return True

    def roots(self) -> list[RadixNode]:
        """Every root: the unsalted one and one per `cache_salt` seen."""
        return list(self._roots.values())

    def root_of(self, node: RadixNode) -> RadixNode:
        while not node.is_root:
            node = node.parent  # type: ignore[assignment]
        return node

    def last_hash(self, node: RadixNode) -> bytes:
        """The chained hash at the end of `node` (its root's namespace digest for a root)."""
        return node.hashes[-1] if node.hashes else self._root_hashes[node]

    # -- lookup -----------------------------------------------------------------------------

    def walk(
        self, tokens: list[int], max_pages: int | None = None, root: RadixNode | None = None
    ) -> Walk:
        """Follow `tokens` (a list) from `root` (default: the unsalted root); no split, no touch."""
        ps = self.page_size
        n_pages = len(tokens) // ps
        if max_pages is not None:
            n_pages = min(n_pages, max_pages)
        end = n_pages * ps
        node, pos, path = root or self.root, 0, []
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            run = child.tokens
            stop = pos + len(run)
            if stop <= end and tokens[pos:stop] == run:
                path.append(child)
                node, pos = child, stop
                continue
            return Walk(path, child, self._common_pages(child, tokens, pos, end))
        return Walk(path, None, 0)

    def _common_pages(self, node: RadixNode, tokens: list[int], pos: int, end: int) -> int:
        """Leading pages of `node` equal to `tokens[pos:end]` (the first is known equal)."""
        ps, run = self.page_size, node.tokens
        for k in range(1, node.num_pages):
            a = pos + k * ps
            if a + ps > end or tokens[a : a + ps] != run[k * ps : (k + 1) * ps]:
                return k
        return node.num_pages

    def match(
        self, tokens: list[int], max_pages: int | None = None, root: RadixNode | None = None
    ) -> list[RadixNode]:
        """The path of nodes covering the longest cached page prefix of `tokens`.

        A partially matched node is split so the path ends exactly at the match.
        """
        walk = self.walk(tokens, max_pages, root)
        path = walk.path
        if walk.partial is not None:
            path.append(self.split(walk.partial, walk.partial_pages))
        return path

    # -- structure --------------------------------------------------------------------------

    def split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after its first `k` pages; returns the new parent holding them."""
        if not 0 < k < node.num_pages:
            raise ValueError(f"cannot split a {node.num_pages}-page node at {k}")
        ps, parent = self.page_size, node.parent
        assert parent is not None, "the root is never split"
        cut = k * ps
        mid = RadixNode(parent, node.tokens[:cut], node.hashes[:k], node.start_page + k)
        mid.device = node.device[:k] if node.device is not None else None
        mid.host = node.host[:k] if node.host is not None else None
        mid.lock_ref = node.lock_ref  # every lock through `node` also runs through `mid`
        mid.host_ref = node.host_ref
        mid.last_access = node.last_access
        mid.hit_count = node.hit_count
        mid.no_store = node.no_store
        parent.children[tuple(node.tokens[:ps])] = mid
        node.tokens = node.tokens[cut:]
        node.hashes = node.hashes[k:]
        if node.device is not None:
            node.device = node.device[k:]
        if node.host is not None:
            node.host = node.host[k:]
        node.parent = mid
        mid.children[tuple(node.tokens[:ps])] = node
        return mid

    def insert(
        self,
        tokens: list[int],
        values: list[int],
        tier: Tier,
        start: RadixNode | None = None,
    ) -> InsertOutcome:
        """Record that `values[i]` (pages of `tier`) hold page `start.end_page + i` of `tokens`.

        Where a node already holds those tokens in `tier`, its pages win and the
        caller's become `duplicates`; where it holds them in another tier only,
        it adopts the caller's pages. New pages get a new leaf and their hashes.
        """
        ps = self.page_size
        node = self.root if start is None else start
        pos = node.end_page * ps
        end = pos + len(values) * ps
        if end > len(tokens):
            raise ValueError(f"{len(values)} pages from page {node.end_page} exceed the tokens")
        pages: list[int] = []
        duplicates: list[int] = []
        taken: list[int] = []
        i = 0
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = child.num_pages
            if pos + n * ps > end or tokens[pos : pos + n * ps] != child.tokens:
                n = self._common_pages(child, tokens, pos, end)
                if n < child.num_pages:
                    child = self.split(child, n)
            mine = values[i : i + n]
            have = getattr(child, tier)
            if have is None:
                setattr(child, tier, mine)
                pages += mine
                taken += mine
            else:
                pages += have
                if have != mine:
                    duplicates += [p for p, q in zip(mine, have, strict=True) if p != q]
            i += n
            pos += n * ps
            node = child
        new_node = None
        if pos < end:
            new_node = self._add_leaf(node, tokens[pos:end], tier, values[i:])
            pages += values[i:]
            taken += values[i:]
            node = new_node
        return InsertOutcome(node, pages, duplicates, taken, new_node)

    def _add_leaf(
        self, parent: RadixNode, run: list[int], tier: Tier, values: list[int]
    ) -> RadixNode:
        last = self.last_hash(parent)
        hashes = chain_hashes(last, run, self.page_size)
        leaf = RadixNode(parent, run, hashes, parent.end_page + len(hashes))
        setattr(leaf, tier, values)
        leaf.last_access = parent.last_access
        parent.children[tuple(run[: self.page_size])] = leaf
        return leaf

    def remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        """Detach `node` and everything below it; returns the detached nodes."""
        parent = node.parent
        if parent is None:
            raise ValueError("cannot remove the root or a detached node")
        if node.lock_ref or node.host_ref:
            raise RuntimeError(f"removing a locked node: {node}")
        del parent.children[tuple(node.tokens[: self.page_size])]
        removed = list(self._iter_from(node))
        for n in removed:
            n.parent = None
        if parent.is_root:
            self._drop_if_idle(parent)
        return removed

    def is_attached(self, node: RadixNode) -> bool:
        return node in self._root_hashes or node.parent is not None

    # -- locks and LRU ----------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect the path to `node` whole: L1 pages, L2 slots and the nodes themselves."""
        self._count(node, "lock_ref", 1, "unlock")

    def unlock(self, node: RadixNode) -> None:
        self._count(node, "lock_ref", -1, "unlock")

    def hold_host(self, node: RadixNode) -> None:
        """Protect the L2 copies on the path to `node` (its L1 copies stay evictable)."""
        self._count(node, "host_ref", 1, "release_host")

    def release_host(self, node: RadixNode) -> None:
        self._count(node, "host_ref", -1, "release_host")

    def _count(self, node: RadixNode, ref: str, delta: int, verb: str) -> None:
        """Add `delta` to `ref` of every node on the path to `node`. A release checks the
        whole path before changing any count, so a stray one changes nothing."""
        if delta < 0:
            n = node
            while not n.is_root:
                if getattr(n, ref) <= 0:
                    raise RuntimeError(f"{verb} without a matching {ref} at {n}")
                n = n.parent  # type: ignore[assignment]
        while not node.is_root:
            setattr(node, ref, getattr(node, ref) + delta)
            node = node.parent  # type: ignore[assignment]
        # The root counts too (a locked salted root is never dropped); a root handle's lock
        # (a match that cached nothing) counts here alone.
        setattr(node, ref, max(0, getattr(node, ref) + delta))
        if delta < 0 and not node.lock_ref and not node.host_ref and node is not self.root:
            self._idle.add(node)

    def touch(self, node: RadixNode) -> None:
        """Mark the path to `node` used now (one tick for the whole path)."""
        self._clock += 1
        now = self._clock
        while not node.is_root:
            node.last_access = now
            node = node.parent  # type: ignore[assignment]

    def path(self, node: RadixNode) -> list[RadixNode]:
        """Nodes from the root's child down to `node`."""
        out: list[RadixNode] = []
        while not node.is_root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        out.reverse()
        return out

    # -- eviction ---------------------------------------------------------------------------

    def evictable(
        self, tier: Tier, priority: Callable[[RadixNode], tuple[Any, ...]] | None = None
    ) -> Iterator[RadixNode]:
        """Unlocked leaves of `tier` (nodes in it with no child in it), LRU first.

        Ties go to the deeper node (suffix before prefix). After the caller has
        dropped a yielded node from `tier`, its parent is offered when it became
        a leaf of the tier.
        """
        prio = priority or (lambda n: (n.last_access, -n.end_page))
        seq = itertools.count()
        heap = [(prio(n), next(seq), n) for n in self.iter_nodes() if self._is_leaf_of(n, tier)]
        heapq.heapify(heap)
        while heap:
            node = heapq.heappop(heap)[2]
            if node.parent is None or not self._is_leaf_of(node, tier):
                continue  # changed since it was queued
            parent = node.parent  # before the yield: a caller that removes `node` detaches it
            yield node
            if parent is not None and self._is_leaf_of(parent, tier):
                heapq.heappush(heap, (prio(parent), next(seq), parent))

    def _is_leaf_of(self, node: RadixNode, tier: Tier) -> bool:
        if node.is_root or node.lock_ref or getattr(node, tier) is None:
            return False
        if node.host_ref and (tier == Tier.HOST or node.host is None):
            return False  # its L2 copy is held, or dropping L1 would drop the node
        return all(getattr(c, tier) is None for c in node.children.values())

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        for root in list(self._roots.values()):
            for child in list(root.children.values()):
                yield from self._iter_from(child)

    def iter_subtree(self, root: RadixNode) -> Iterator[RadixNode]:
        """Every node below `root` (not `root` itself), parents before children."""
        for child in list(root.children.values()):
            yield from self._iter_from(child)

    def iter_tier(self, tier: Tier) -> Iterator[RadixNode]:
        """Every node resident in `tier`, when residency is prefix-closed (L1 is):
        only subtrees whose top is in the tier are walked."""
        for root in list(self._roots.values()):
            stack = [c for c in root.children.values() if getattr(c, tier) is not None]
            while stack:
                n = stack.pop()
                yield n
                stack.extend(c for c in n.children.values() if getattr(c, tier) is not None)

    def _iter_from(self, node: RadixNode) -> Iterator[RadixNode]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
