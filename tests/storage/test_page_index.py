"""The LRU index: exact eviction order (suffix before prefix), accounting, scan merge, pins,
parents, and the listener that sees every change in order."""

from __future__ import annotations

from collections.abc import Sequence

from asynchicache.storage.page_index import IndexedPage, PageIndex

A = [b"a0", b"a1", b"a2"]
B = [b"b0", b"b1"]


def pages(hashes: list[bytes], size: int = 10, parent: bytes = b"") -> list[IndexedPage]:
    """A chain: each page's parent is the previous one (the first's is `parent`)."""
    parents = [parent, *hashes[:-1]]
    return [IndexedPage(h, size, p) for h, p in zip(hashes, parents, strict=True)]


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, tuple[bytes, ...]]] = []

    def stored(self, pages: Sequence[IndexedPage]) -> None:
        self.log.append(("stored", tuple(p.page_hash for p in pages)))

    def removed(self, hashes: Sequence[bytes]) -> None:
        self.log.append(("removed", tuple(hashes)))

    def cleared(self) -> None:
        self.log.append(("cleared", ()))


def test_chain_is_evicted_suffix_first() -> None:
    idx = PageIndex()
    idx.add_chain(pages(A))
    assert idx.lru_order() == [b"a2", b"a1", b"a0"]
    victims = idx.pop_lru(20)
    assert [h for h, _ in victims] == [b"a2", b"a1"]
    assert idx.bytes_used == 10
    idx.commit(pages(B), written=B)
    assert idx.lru_order() == [b"a0", b"b1", b"b0"]
    assert idx.bytes_used == 30


def test_touch_keeps_prefix_most_recent() -> None:
    idx = PageIndex()
    idx.add_chain(pages(A, 1))
    idx.add_chain(pages(B, 1))
    idx.touch_chain([b"a0", b"a1", b"zz"])
    assert idx.lru_order() == [b"a2", b"b1", b"b0", b"a1", b"a0"]
    assert idx.leading([b"a0", b"a1", b"zz", b"a2"]) == 2


def test_pop_lru_takes_what_there_is() -> None:
    idx = PageIndex()
    idx.add_chain([IndexedPage(b"x", 5)])
    assert idx.pop_lru(100) == [(b"x", 5)] and idx.pop_lru(100) == []
    assert idx.bytes_used == 0 and len(idx) == 0


def test_re_adding_a_page_does_not_count_it_twice() -> None:
    idx = PageIndex()
    idx.add_chain([IndexedPage(b"x", 5)])
    idx.add_chain([IndexedPage(b"x", 7)])
    assert idx.bytes_used == 5 and len(idx) == 1
    assert idx.remove(b"x") == 5 and idx.remove(b"x") is None and idx.bytes_used == 0


def test_commit_does_not_bring_back_a_page_evicted_meanwhile() -> None:
    idx = PageIndex()
    idx.add_chain(pages(A))
    idx.pop_lru(10)  # a2 evicted by another put while this one wrote b0
    got = idx.commit([*pages(A), IndexedPage(b"b0", 10)], written=[b"b0"])
    assert got == {b"a0", b"a1", b"b0"} and b"a2" not in idx


def test_scan_orders_by_stamp_and_keeps_fresh_pages_newest() -> None:
    idx = PageIndex()
    idx.begin_scan()
    idx.add_chain([IndexedPage(b"new", 1)])  # stored while the scan runs
    idx.add_scanned([IndexedPage(b"s2", 1, stamp_ns=300), IndexedPage(b"s0", 1, stamp_ns=100)])
    idx.add_scanned([IndexedPage(b"s1", 1, stamp_ns=200), IndexedPage(b"new", 1, stamp_ns=50)])
    idx.touch_chain([b"s0"])  # used during the scan: no longer ordered by its stamp
    idx.end_scan()
    assert idx.lru_order() == [b"s1", b"s2", b"new", b"s0"]
    assert idx.bytes_used == 4


def test_pinned_pages_are_never_victims_and_rejoin_when_unpinned() -> None:
    idx = PageIndex()
    idx.set_pins(frozenset([b"a0", b"a1", b"b0"]))  # b0 not stored yet: pinned on arrival
    idx.add_chain(pages(A))
    idx.add_chain(pages(B))
    assert idx.lru_order() == [b"a2", b"b1"] and idx.pinned_pages == 3
    assert idx.leading(A) == 3 and idx.bytes_used == 50
    assert [h for h, _ in idx.pop_lru(1000)] == [b"a2", b"b1"]
    assert idx.pop_lru(1000) == [] and len(idx) == 3
    idx.set_pins(frozenset([b"a0"]))
    assert set(idx.lru_order()) == {b"a1", b"b0"} and idx.pinned_pages == 1
    assert [h for h, _ in idx.pop_lru(1000)] != [] and list(idx.parents()) == [b"a0"]


def test_parents_and_snapshot() -> None:
    idx = PageIndex()
    idx.add_chain(pages(A, parent=b"root"))
    assert idx.parents() == {b"a0": b"root", b"a1": b"a0", b"a2": b"a1"}
    snap, mark = idx.snapshot(lambda: 7)
    assert sorted(snap) == [(b"a0", b"root"), (b"a1", b"a0"), (b"a2", b"a1")] and mark == 7


def test_the_listener_sees_every_change_in_order() -> None:
    rec = Recorder()
    idx = PageIndex(rec)
    idx.add_chain(pages(A))
    idx.add_chain(pages(A))  # a touch: nothing new
    idx.pop_lru(10)
    idx.commit(pages(B), written=B)
    idx.remove_many([b"b1", b"zz"])
    idx.clear()
    assert rec.log == [
        ("stored", (b"a0", b"a1", b"a2")),
        ("removed", (b"a2",)),
        ("stored", (b"b0", b"b1")),
        ("removed", (b"b1",)),
        ("cleared", ()),
    ]
