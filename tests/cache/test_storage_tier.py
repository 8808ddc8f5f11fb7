"""HiRadixCache over a storage tier (L3) through the `StorageTier` protocol: stores after
the L2 copy, loads back (alone or with L2 pages), short reads, store holds and failures."""

from __future__ import annotations

import time

import pytest
import torch
from cache_helpers import (
    PAGE,
    MakeCache,
    device_values,
    load_now,
    only_in_storage,
    put,
    release,
    storage_of,
    tokens_for,
)

from asynchicache.hierarchy.l2.ledger import SlotState


def test_pages_go_to_storage_after_their_l2_copy_and_load_back(make_cache: MakeCache) -> None:
    cache = make_cache(with_storage=True)
    store = storage_of(cache)
    tokens = tokens_for(1, 2, 3)
    put(cache, tokens, value=40.0)
    cache.drain()
    assert store.stores == 3
    assert cache.stats().counters.host_to_storage_pages == 3
    cache.clear()
    assert cache.lookup(tokens) == {"device": 0, "host": 0, "disk": 3 * PAGE, "remote": 0}
    match = cache.match(tokens)
    assert match.storage_hit_pages == 3 and match.cached_tokens == 3 * PAGE
    ticket = load_now(cache, match)
    assert ticket.pages_from_storage == 3
    assert ticket.ok and device_values(cache, ticket.device_pages) == [40.0, 41.0, 42.0]
    release(cache, ticket)
    assert cache.lookup(tokens) == {"device": 3 * PAGE, "host": 0, "disk": 0, "remote": 0}
    assert cache.stats().counters.storage_to_host_pages == 3


def test_load_combines_host_and_storage_pages(make_cache: MakeCache) -> None:
    cache = make_cache(with_storage=True)
    tokens = tokens_for(1, 2, 3, 4)
    put(cache, tokens, value=50.0)
    cache.drain()
    cache.evict(8)  # all four in L2 (and storage)
    cache.evict_host(2)  # the last two only in storage now
    match = cache.match(tokens)
    assert (len(match.device_pages), match.host_hit_pages, match.storage_hit_pages) == (0, 2, 2)
    ticket = load_now(cache, match)
    assert ticket.ok and (ticket.pages_from_host, ticket.pages_from_storage) == (2, 2)
    assert device_values(cache, ticket.device_pages) == [50.0, 51.0, 52.0, 53.0]
    release(cache, ticket)
    cache.check_integrity()


def test_short_storage_read_truncates_to_the_verified_prefix(make_cache: MakeCache) -> None:
    cache = make_cache(with_storage=True)
    store = storage_of(cache)
    tokens = tokens_for(1, 2, 3)
    only_in_storage(cache, tokens, 60.0)
    store.load_limit = 1
    ticket = load_now(cache, cache.match(tokens))
    assert not ticket.ok and ticket.error and "1 of 3" in ticket.error
    assert device_values(cache, ticket.device_pages) == [60.0]
    release(cache, ticket)
    stats = cache.stats()
    assert stats.counters.load_failures == 1
    assert stats.device.in_use == 0 and stats.host is not None and stats.host.in_use == 0


def test_slots_under_store_stay_put_until_the_store_completes(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=4, host_slots=2, with_storage=True)
    store = storage_of(cache)
    store.hold = True
    tokens = tokens_for(1, 2)
    node = put(cache, tokens, value=70.0).handle.node
    deadline = time.monotonic() + 10
    while cache.parts.transfers and time.monotonic() < deadline:
        cache.poll()
    cache.start_stores()  # not waiting for a quiet engine (store_queue.py)
    assert node.host is not None and all(
        cache.parts.host.state(s) == SlotState.STORING for s in node.host
    )
    assert cache.evict_host(2) == 0 and cache.clear() == 2  # L1 copy goes, L2 stays
    cache.check_integrity()
    store.hold = False
    cache.drain()
    assert store.stores == 2 and cache.evict_host(2) == 2
    assert cache.lookup(tokens)["disk"] == 2 * PAGE
    cache.check_integrity()


def test_disk_admission_by_hits_and_by_prompt_length(make_cache: MakeCache) -> None:
    cache = make_cache(with_storage=True, disk_admit_hits=2, disk_admit_tokens=3 * PAGE)
    store = storage_of(cache)
    short, long_ = tokens_for(1), tokens_for(2, 3, 4)
    put(cache, short)
    put(cache, long_)
    cache.drain()
    assert store.stores == 3  # only the long prompt's pages
    cache.match(short)
    cache.drain()
    assert store.stores == 3
    cache.match(short)  # second hit: admitted
    cache.drain()
    assert store.stores == 4
    cache.check_integrity()


def test_byte_check_of_a_page_through_storage(make_cache: MakeCache) -> None:
    cache = make_cache(with_storage=True)
    tokens = tokens_for(1)
    pages = cache.allocate(1)
    assert pages is not None
    payload = torch.randn(cache.layout.page_shape)
    cache.device_pool.tensor[pages[0]].copy_(payload)
    cache.unlock(cache.insert(tokens, pages).handle)
    cache.drain()
    cache.clear()
    ticket = load_now(cache, cache.match(tokens))
    assert torch.equal(cache.device_pool.tensor[ticket.device_pages[0]], payload)
    release(cache, ticket)


def test_a_failing_storage_store_is_counted_and_the_pages_stay_in_l2(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(with_storage=True)

    def broken(pages):  # type: ignore[no-untyped-def]
        raise ConnectionError("service down")

    monkeypatch.setattr(storage_of(cache), "submit_store", broken)
    node = put(cache, tokens_for(1)).handle.node
    cache.drain()
    cache.check_integrity()
    assert cache.stats().counters.store_failures == 1
    assert node.host is not None and cache.parts.host.state(node.host[0]) == SlotState.READY
    assert cache.evict_host(1) == 1  # nothing holds the slot after the failure
