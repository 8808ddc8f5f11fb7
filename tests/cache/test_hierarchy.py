"""HiRadixCache: write policies, eviction across tiers, loads, locks, integrity (storage:
test_storage_tier.py)."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import PAGE, MakeCache, device_values, finish, put, release, tokens_for

from asynchicache.hierarchy import HiRadixCache, IntegrityError
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.settings.config import WritePolicy


def host_value(cache: HiRadixCache, slot: int) -> float:
    assert cache.host_pool is not None and cache.host_pool.tensor is not None
    page = cache.host_pool.tensor[slot]
    assert page.eq(page.flatten()[0]).all()
    return float(page.flatten()[0])


def test_write_through_copies_to_host_at_insert(make_cache: MakeCache) -> None:
    cache = make_cache(policy=WritePolicy.WRITE_THROUGH)
    tokens = tokens_for(1, 2, 3)
    result = put(cache, tokens, value=10.0)
    node = result.handle.node
    assert node.host is not None and len(node.host) == 3
    cache.drain()
    cache.check_integrity()
    assert [cache.parts.host.state(s) for s in node.host] == [SlotState.READY] * 3
    assert [host_value(cache, s) for s in node.host] == [10.0, 11.0, 12.0]
    stats = cache.stats()
    assert stats.counters.device_to_host_pages == 3
    assert stats.counters.device_to_host_bytes == 3 * cache.layout.page_bytes


def test_write_back_copies_only_on_eviction(make_cache: MakeCache) -> None:
    cache = make_cache(policy=WritePolicy.WRITE_BACK)
    tokens = tokens_for(1, 2)
    result = put(cache, tokens, value=5.0)
    assert result.handle.node.host is None and cache.pending == 0
    assert cache.evict(2) == 2
    cache.check_integrity()
    match = cache.match(tokens)
    assert match.device_pages == [] and match.host_hit_pages == 2
    assert [host_value(cache, s) for s in result.handle.node.host or []] == [5.0, 6.0]


def test_write_through_selective_waits_for_hits(make_cache: MakeCache) -> None:
    cache = make_cache(policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_through_threshold=2)
    tokens = tokens_for(1, 2)
    node = put(cache, tokens).handle.node
    cache.match(tokens)
    assert node.host is None  # one hit is not enough
    cache.match(tokens)
    assert node.host is not None
    cache.drain()
    cache.check_integrity()
    assert cache.stats().counters.device_to_host_pages == 2
    # Without a backup, an L1 eviction under a write-through policy drops the pages.
    other = put(cache, tokens_for(7)).handle.node
    cache.evict(8)
    assert not cache.tree.is_attached(other)
    assert cache.lookup(tokens) == {"device": 0, "host": 2 * PAGE, "disk": 0, "remote": 0}


def test_l1_eviction_keeps_the_l2_copy_and_match_splits_the_tiers(make_cache: MakeCache) -> None:
    cache = make_cache()
    tokens = tokens_for(1, 2, 3, 4)
    result = put(cache, tokens, value=20.0)
    cache.drain()
    assert cache.evict(1) == 1  # only the last page: the suffix goes first
    cache.check_integrity()
    match = cache.match(tokens)
    assert match.device_pages == result.device_pages[:3]
    assert match.host_hit_pages == 1 and match.storage_hit_pages == 0
    assert match.cached_tokens == 4 * PAGE and match.device_tokens == 3 * PAGE
    assert cache.stats().counters.device_evicted_pages == 1


def test_l2_eviction_frees_slots_and_removes_nodes_that_live_nowhere(
    make_cache: MakeCache,
) -> None:
    cache = make_cache(device_pages=4, host_slots=4)
    a, b, c = tokens_for(1, 2), tokens_for(3, 4), tokens_for(5, 6)
    put(cache, a, value=1.0)
    cache.drain()
    cache.evict(4)  # a now only in L2
    put(cache, b, value=3.0)
    cache.drain()
    cache.evict(4)  # b only in L2: L2 is full (a, b)
    put(cache, c, value=5.0)  # its write-through must evict a (least recently used)
    cache.drain()
    cache.check_integrity()
    assert cache.lookup(a) == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert cache.lookup(b)["host"] == 2 * PAGE
    assert cache.lookup(c)["device"] == 2 * PAGE and cache.lookup(c)["host"] == 0
    stats = cache.stats()
    assert stats.counters.host_evicted_pages == 2
    assert stats.host is not None and stats.host.cached == 4 and stats.host.free == 0


def test_host_eviction_prefers_runs_no_longer_in_l1(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=4)
    in_both = tokens_for(1, 2)
    only_host = tokens_for(3, 4)
    put(cache, only_host)
    cache.drain()
    cache.evict(2)
    put(cache, in_both)
    cache.drain()
    assert cache.evict_host(2) == 2
    cache.check_integrity()
    assert cache.lookup(only_host)["host"] == 0
    assert cache.lookup(in_both) == {"device": 2 * PAGE, "host": 0, "disk": 0, "remote": 0}


def test_async_load_from_host_completes_through_poll(make_cache: MakeCache) -> None:
    cache = make_cache()
    tokens = tokens_for(1, 2, 3)
    put(cache, tokens, value=30.0)
    cache.drain()
    cache.evict(2)
    match = cache.match(tokens)
    assert len(match.device_pages) == 1 and match.host_hit_pages == 2
    ticket = cache.load(match)
    assert ticket is not None and not ticket.done
    assert ticket.pages_from_host == 2
    cache.check_integrity()  # in flight: the reserved L1 pages are accounted for
    finish(cache, ticket)
    assert ticket.ok and ticket.error is None and len(ticket.device_pages) == 3
    assert device_values(cache, ticket.device_pages) == [30.0, 31.0, 32.0]
    assert ticket.handle is not None and ticket.handle.node.lock_ref == 1
    assert cache.evict(8) == 0  # the loaded path is locked for the caller
    cache.unlock(ticket.handle)
    assert ticket.handle.node.lock_ref == 0
    assert cache.stats().counters.host_to_device_pages == 2
    assert cache.load(cache.match(tokens)) is None  # everything is on L1 now


def test_load_protects_its_pages_until_done(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=4, host_slots=4)
    tokens = tokens_for(1, 2)
    put(cache, tokens)
    cache.drain()
    cache.evict(4)
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None
    cache.clear()  # must not drop the L2 pages the load reads
    cache.check_integrity()
    finish(cache, ticket)
    assert ticket.ok and len(ticket.device_pages) == 2
    release(cache, ticket)


def test_lock_prevents_eviction_and_counts_are_exact(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=4, host_slots=0)
    tokens = tokens_for(1, 2)
    put(cache, tokens)
    match = cache.match(tokens)
    cache.lock(match.handle)
    cache.lock(match.handle)
    assert match.handle.node.lock_ref == 2
    assert cache.allocate(3) is None  # two free pages, the other two are locked
    assert cache.evict(4) == 0
    cache.unlock(match.handle)
    assert cache.evict(4) == 0  # still locked once
    cache.unlock(match.handle)
    assert match.handle.node.lock_ref == 0
    with pytest.raises(RuntimeError):
        cache.unlock(match.handle)
    pages = cache.allocate(4)
    assert pages is not None and len(pages) == 4
    cache.check_integrity()
    with pytest.raises(ValueError, match="stale"):
        cache.lock(match.handle)  # its pages were evicted to make room
    cache.free(pages)


def test_insert_dedups_against_the_tree_and_fixes_the_page_table(make_cache: MakeCache) -> None:
    cache = make_cache(host_slots=0)
    tokens = tokens_for(1, 2, 3)
    first = put(cache, tokens)
    # A second request computed the same prompt itself (plus a partial page).
    pages = cache.allocate(4)
    assert pages is not None
    result = cache.insert([*tokens, 9], pages)
    assert result.device_pages == [*first.device_pages, pages[3]]
    assert cache.stats().device.free == 8 - 3 - 1
    cache.unlock(result.handle)
    cache.free([pages[3]])
    cache.check_integrity()


def test_insert_extends_a_matched_prefix(make_cache: MakeCache) -> None:
    cache = make_cache(host_slots=0)
    put(cache, tokens_for(1, 2))
    longer = tokens_for(1, 2, 3)
    match = cache.match(longer)
    cache.lock(match.handle)
    extra = cache.allocate(1)
    assert extra is not None
    result = cache.insert(longer, match.device_pages + extra)
    cache.unlock(match.handle)
    assert result.device_pages == match.device_pages + extra
    assert cache.match(longer).device_pages == result.device_pages
    cache.unlock(result.handle)
    cache.check_integrity()


def test_insert_rejects_pages_it_does_not_own(make_cache: MakeCache) -> None:
    cache = make_cache(host_slots=0)
    tree_pages = put(cache, tokens_for(1, 2)).device_pages
    mine = cache.allocate(2)
    assert mine is not None
    with pytest.raises(ValueError, match="neither private"):
        cache.insert(tokens_for(5, 6), [mine[0], tree_pages[0]])
    with pytest.raises(ValueError, match="twice"):
        cache.insert(tokens_for(5, 6), [mine[0], mine[0]])
    with pytest.raises(ValueError, match="not private"):
        cache.free(tree_pages)
    cache.free(mine)
    cache.check_integrity()


def test_max_pages_lookup_and_lru_untouched_by_lookup(make_cache: MakeCache) -> None:
    cache = make_cache(host_slots=0)
    a = tokens_for(1, 2, 3)
    b = tokens_for(4)
    put(cache, a)
    put(cache, b)
    assert len(cache.match(a, max_pages=2).device_pages) == 2
    assert cache.match(a, max_pages=0).device_pages == []
    put(cache, b)  # b is now the most recent...
    assert cache.lookup(a)["device"] == 3 * PAGE  # ...and a lookup does not change that
    cache.evict(1)
    assert cache.lookup(a)["device"] == 2 * PAGE and cache.lookup(b)["device"] == PAGE


def test_clear_and_stats(make_cache: MakeCache) -> None:
    cache = make_cache()
    put(cache, tokens_for(1, 2))
    kept = put(cache, tokens_for(3), keep_lock=True)
    cache.drain()
    assert cache.clear() == 2 + 2  # a's two pages from L1 and from L2; the locked one stays
    cache.check_integrity()
    stats = cache.stats()
    assert stats.device.cached == 1 and stats.device.free == 7 and stats.device.in_use == 0
    assert stats.host is not None and stats.host.cached == 1
    cache.unlock(kept.handle)
    assert stats.to_dict()["device"]["total"] == 8


def test_l1_only_cache_without_host_tier(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=4, host_slots=0)
    assert cache.host_pool is None
    put(cache, tokens_for(1, 2))
    put(cache, tokens_for(3, 4))
    put(cache, tokens_for(5))  # evicts the LRU run's last page for good
    assert cache.lookup(tokens_for(1, 2))["device"] == PAGE
    put(cache, tokens_for(6, 7))
    assert cache.lookup(tokens_for(1, 2))["device"] == 0
    assert cache.stats().host is None
    cache.check_integrity()


def test_check_integrity_reports_what_is_wrong(make_cache: MakeCache) -> None:
    cache = make_cache(host_slots=0)
    a = put(cache, tokens_for(1)).handle.node
    b = put(cache, tokens_for(2)).handle.node
    assert a.device is not None
    b.device = list(a.device)  # one L1 page owned twice, another lost
    with pytest.raises(IntegrityError, match="owned by"):
        cache.check_integrity()
    b.device = None
    with pytest.raises(IntegrityError, match="lives in no tier"):
        cache.check_integrity()


def test_a_failed_copy_is_counted_and_later_copies_still_run(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache()
    real_submit = cache.transfer.submit
    wrong = torch.zeros(8, 3)  # a destination of the wrong shape makes the copy raise

    def failing_submit(src, src_pages, dst, dst_pages):  # type: ignore[no-untyped-def]
        return real_submit(src, src_pages, wrong, dst_pages)

    monkeypatch.setattr(cache.transfer, "submit", failing_submit)
    node = put(cache, tokens_for(1, 2)).handle.node
    cache.drain()
    cache.check_integrity()
    assert node.host is None and cache.stats().counters.transfer_failures == 1
    assert cache.stats().host is not None and cache.stats().host.free == 8  # type: ignore[union-attr]
    monkeypatch.setattr(cache.transfer, "submit", real_submit)
    other = put(cache, tokens_for(3)).handle.node
    cache.drain()
    assert other.host is not None and cache.stats().counters.device_to_host_pages == 1
