"""The radix tree alone: matching, splitting, hashes, locks and the exact eviction order."""

from __future__ import annotations

import pytest

from asynchicache.common.keys import Namespace, page_hashes
from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.radix import RadixTree

PS = 4
NS = Namespace("radix-test", "float32", PS)


def toks(*page_ids: int) -> list[int]:
    """PS tokens per page id (page id k -> [k*10, k*10+1, ...])."""
    return [k * 10 + i for k in page_ids for i in range(PS)]


def tree() -> RadixTree:
    return RadixTree(PS, NS.digest())


def pages_of(path: list[RadixNode]) -> list[int]:
    out: list[int] = []
    for node in path:
        out += node.device or []
    return out


def test_insert_then_match_returns_pages_and_hashes() -> None:
    t = tree()
    tokens = toks(1, 2, 3)
    out = t.insert(tokens, [7, 8, 9], Tier.DEVICE)
    assert out.pages == [7, 8, 9] and out.taken == [7, 8, 9] and out.duplicates == []
    assert out.node.hashes == page_hashes(NS, tokens)
    assert pages_of(t.match(tokens)) == [7, 8, 9]
    # A trailing partial page and extra tokens do not matter; max_pages caps the match.
    assert pages_of(t.match([*tokens, 5, 5])) == [7, 8, 9]
    assert pages_of(t.match(toks(1, 2, 3, 4))) == [7, 8, 9]
    assert pages_of(t.match(tokens, max_pages=2)) == [7, 8]
    assert t.match(toks(2, 3)) == []


def test_divergence_splits_and_keeps_node_identity_for_the_suffix() -> None:
    t = tree()
    first = t.insert(toks(1, 2, 3, 4), [0, 1, 2, 3], Tier.DEVICE).node
    t.lock(first)
    second = t.insert(toks(1, 2, 5), [0, 1, 4], Tier.DEVICE)
    assert second.pages == [0, 1, 4] and second.duplicates == [] and second.taken == [4]
    mid = first.parent
    assert mid is not None and mid.device == [0, 1] and mid.end_page == 2
    assert first.device == [2, 3] and first.start_page == 2 and first.end_page == 4
    assert mid.lock_ref == 1  # the lock taken through `first` now runs through `mid`
    assert first.hashes == page_hashes(NS, toks(1, 2, 3, 4))[2:]
    assert second.node.hashes == page_hashes(NS, toks(1, 2, 5))[2:]
    t.unlock(first)
    assert mid.lock_ref == 0 and first.lock_ref == 0


def test_match_splits_a_partly_matched_node() -> None:
    t = tree()
    leaf = t.insert(toks(1, 2, 3, 4), [0, 1, 2, 3], Tier.DEVICE).node
    walk = t.walk(toks(1, 2, 9))
    assert walk.path == [] and walk.partial is leaf and walk.partial_pages == 2
    path = t.match(toks(1, 2, 9))
    assert (
        len(path) == 1 and path[0].device == [0, 1] and path[0].children == {tuple(toks(3)): leaf}
    )


def test_insert_keeps_existing_pages_and_reports_duplicates() -> None:
    t = tree()
    t.insert(toks(1, 2), [0, 1], Tier.DEVICE)
    out = t.insert(toks(1, 2, 3), [5, 1, 6], Tier.DEVICE)
    assert out.pages == [0, 1, 6]
    assert out.duplicates == [5]  # page 1 is the tree's own page: not a duplicate
    assert out.taken == [6]


def test_insert_adopts_pages_of_a_tier_the_node_lacks() -> None:
    t = tree()
    node = t.insert(toks(1, 2), [3, 4], Tier.HOST).node
    out = t.insert(toks(1, 2), [8, 9], Tier.DEVICE)
    assert out.node is node and node.host == [3, 4] and node.device == [8, 9]
    assert out.taken == [8, 9]


def test_insert_below_a_start_node_uses_its_page_offset() -> None:
    t = tree()
    base = t.insert(toks(1, 2), [0, 1], Tier.DEVICE).node
    out = t.insert(toks(1, 2, 3, 4), [5, 6], Tier.HOST, start=base)
    assert out.node.parent is base and out.node.host == [5, 6]
    assert out.node.hashes == page_hashes(NS, toks(1, 2, 3, 4))[2:]


def test_lock_counts_are_exact_along_the_path() -> None:
    t = tree()
    a = t.insert(toks(1, 2, 3), [0, 1, 2], Tier.DEVICE).node
    b = t.insert(toks(1, 2, 4), [0, 1, 3], Tier.DEVICE).node
    mid = a.parent
    assert mid is not None and mid is b.parent
    t.lock(a)
    t.lock(a)
    t.lock(b)
    assert (mid.lock_ref, a.lock_ref, b.lock_ref) == (3, 2, 1)
    t.unlock(a)
    assert (mid.lock_ref, a.lock_ref, b.lock_ref) == (2, 1, 1)
    t.unlock(a)
    t.unlock(b)
    assert (mid.lock_ref, a.lock_ref, b.lock_ref) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="without a matching lock"):
        t.unlock(b)
    assert b.lock_ref == 0 and mid.lock_ref == 0  # a failed unlock changes nothing


def _evict_all(t: RadixTree) -> list[list[int]]:
    order = []
    for node in t.evictable(Tier.DEVICE):
        order.append(node.device)
        node.device = None
    return order


def test_eviction_order_is_lru_and_suffix_first() -> None:
    t = tree()
    a = t.insert(toks(1, 2, 3), [0, 1, 2], Tier.DEVICE).node  # P=[1] + A=[2, 3]
    t.touch(a)
    b = t.insert(toks(1, 4), [0, 3], Tier.DEVICE).node  # splits P off; B=[4]
    t.touch(b)
    c = t.insert(toks(5), [4], Tier.DEVICE).node
    t.touch(c)
    # A is the oldest leaf; then B; then their shared prefix P (used with B), then C.
    assert _evict_all(t) == [[1, 2], [3], [0], [4]]


def test_touch_reorders_and_locked_leaves_are_skipped() -> None:
    t = tree()
    a = t.insert(toks(1), [0], Tier.DEVICE).node
    t.touch(a)
    b = t.insert(toks(2), [1], Tier.DEVICE).node
    t.touch(b)
    c = t.insert(toks(3), [2], Tier.DEVICE).node
    t.touch(c)
    t.touch(a)  # a is now the most recent
    t.lock(b)
    assert _evict_all(t) == [[2], [0]]
    t.unlock(b)
    assert _evict_all(t) == [[1]]


def test_equal_times_evict_the_deeper_node_first() -> None:
    t = tree()
    a = t.insert(toks(1), [0], Tier.DEVICE).node
    b = t.insert(toks(1, 2), [0, 1], Tier.DEVICE).node
    t.touch(b)
    assert a.last_access == b.last_access
    assert _evict_all(t) == [[1], [0]]


def test_parent_with_a_child_in_the_tier_is_not_a_leaf_of_it() -> None:
    t = tree()
    parent = t.insert(toks(1), [0], Tier.DEVICE).node
    child = t.insert(toks(1, 2), [0, 1], Tier.DEVICE).node
    child.host = [5]
    parent.host = [4]
    order = [n for n in t.evictable(Tier.HOST)]
    assert order == [child]  # the parent only once the child left L2 (it did not here)


def test_remove_subtree_detaches_everything_below() -> None:
    t = tree()
    a = t.insert(toks(1, 2), [0, 1], Tier.DEVICE).node
    t.insert(toks(1, 2, 3), [0, 1, 2], Tier.DEVICE)
    t.insert(toks(1, 2, 4), [0, 1, 3], Tier.DEVICE)
    removed = t.remove_subtree(a)
    assert len(removed) == 3 and all(not t.is_attached(n) for n in removed)
    assert t.root.children == {} and t.match(toks(1, 2, 3)) == []
    with pytest.raises(ValueError):
        t.remove_subtree(a)


def test_split_validates_its_argument() -> None:
    t = tree()
    a = t.insert(toks(1, 2), [0, 1], Tier.DEVICE).node
    for k in (0, 2):
        with pytest.raises(ValueError):
            t.split(a, k)
