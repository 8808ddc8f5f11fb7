"""The LRU index: exact eviction order (suffix before prefix), accounting, scan merge."""

from __future__ import annotations

from asynchicache.storage.page_index import PageIndex, ScannedPage

A = [b"a0", b"a1", b"a2"]
B = [b"b0", b"b1"]


def test_chain_is_evicted_suffix_first() -> None:
    idx = PageIndex()
    idx.add_chain([(h, 10) for h in A])
    assert idx.lru_order() == [b"a2", b"a1", b"a0"]
    grant = idx.reserve(20, capacity=30)
    assert [h for h, _ in grant.victims] == [b"a2", b"a1"]
    assert grant.nbytes == 20 and idx.bytes_used == 10 and idx.bytes_reserved == 20
    idx.commit(grant.nbytes, [(h, 10) for h in B])
    assert idx.lru_order() == [b"a0", b"b1", b"b0"]
    assert idx.bytes_used == 30 and idx.bytes_reserved == 0


def test_touch_keeps_prefix_most_recent() -> None:
    idx = PageIndex()
    idx.add_chain([(h, 1) for h in A])
    idx.add_chain([(h, 1) for h in B])
    idx.touch_chain([b"a0", b"a1", b"zz"])
    assert idx.lru_order() == [b"a2", b"b1", b"b0", b"a1", b"a0"]
    assert idx.leading([b"a0", b"a1", b"zz", b"a2"]) == 2


def test_reserve_more_than_capacity_grants_what_fits() -> None:
    idx = PageIndex()
    idx.add_chain([(b"x", 5)])
    grant = idx.reserve(100, capacity=50)
    assert grant.nbytes == 50 and [h for h, _ in grant.victims] == [b"x"]
    idx.commit(0, [])
    assert idx.bytes_reserved == 50


def test_re_adding_a_page_does_not_count_it_twice() -> None:
    idx = PageIndex()
    idx.add_chain([(b"x", 5)])
    idx.add_chain([(b"x", 7)])
    assert idx.bytes_used == 5 and len(idx) == 1
    assert idx.remove(b"x") == 5 and idx.remove(b"x") is None and idx.bytes_used == 0


def test_scan_orders_by_stamp_and_keeps_fresh_pages_newest() -> None:
    idx = PageIndex()
    idx.begin_scan()
    idx.add_chain([(b"new", 1)])  # stored while the scan runs
    idx.add_scanned([ScannedPage(b"s2", 1, 300), ScannedPage(b"s0", 1, 100)])
    idx.add_scanned([ScannedPage(b"s1", 1, 200), ScannedPage(b"new", 1, 50)])
    idx.touch_chain([b"s0"])  # used during the scan: no longer ordered by its stamp
    idx.end_scan()
    assert idx.lru_order() == [b"s1", b"s2", b"new", b"s0"]
    assert idx.bytes_used == 4
