"""An arrival prefetch (cache.prefetch) never loses the node it reads under: the L2 room
its read needs may evict that very node when it lives in L2 alone (found live: a request
could not be queued, `AttributeError` locking a node eviction had just detached, then
every completion of that read failed the same way)."""

from __future__ import annotations

import time

from cache_helpers import MakeCache, put, storage_of, tokens_for

from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.jobs import LoadTicket


def _landed(cache: HiRadixCache, ticket: LoadTicket) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if ticket in cache.poll():
            cache.unlock(ticket.handle)
            return
    raise AssertionError("the prefetch did not land")


def test_a_prefetch_under_an_l2_only_anchor_keeps_it(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=4, with_storage=True)
    store = storage_of(cache)
    put(cache, tokens_for(1, 2, 3, 4), value=10.0)  # four pages: stored below L2
    cache.drain()
    assert store.stores == 4
    cache.evict(8)
    cache.evict_host(4)  # the tree is empty; storage holds the four pages
    first = cache.prefetch(tokens_for(1, 2), 2)  # pages 1-2 into L2: the anchor to be
    assert first is not None
    _landed(cache, first)
    put(cache, tokens_for(7, 8), value=30.0)  # newer L2 pages: L2 is full now
    cache.drain()
    # Pages 3-4 need two L2 slots: eviction takes the least recently used, the anchor's.
    second = cache.prefetch(tokens_for(1, 2, 3, 4), 2)
    assert second is not None and second.pages_from_storage == 2  # the newer pages made room
    _landed(cache, second)
    cache.check_integrity()
    assert cache.match(tokens_for(1, 2, 3, 4)).host_hit_pages == 4
    assert cache.stats().counters.completion_failures == 0
