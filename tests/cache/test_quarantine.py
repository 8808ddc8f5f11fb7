"""Storage work that runs late never touches an L2 slot the cache reused (issue 11, defect 1).

`MemoryStorage.expire()` makes tickets time out for the client while the
"service" keeps their work; `settle()` runs that work late, touching the slots
as a frozen cache service that wakes up would. A slot under such work is
quarantined until its `Settled`: never freed, never reused, never evicted.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import (
    NS,
    PAGE,
    MakeCache,
    MemoryStorage,
    only_in_storage,
    put,
    release,
    storage_of,
    tokens_for,
)

from asynchicache.common.keys import chain_hashes
from asynchicache.hierarchy import HiRadixCache, LoadTicket
from asynchicache.launch.options import build_parser, to_config
from asynchicache.settings.config import CacheConfig


def host_values(cache: HiRadixCache, slots: list[int]) -> list[float]:
    assert cache.host_pool is not None and cache.host_pool.tensor is not None
    out = []
    for s in slots:
        page = cache.host_pool.tensor[s]
        assert page.eq(page.flatten()[0]).all(), f"slot {s} holds mixed bytes"
        out.append(float(page.flatten()[0]))
    return out


def stored_value(store: MemoryStorage, page_hash: bytes) -> float:
    page = torch.frombuffer(bytearray(store.pages[page_hash]), dtype=torch.float32)
    assert page.eq(page[0]).all()
    return float(page[0])


def step(cache: HiRadixCache) -> list:
    """Let L1 <-> L2 copies land, then complete what finished (storage included)."""
    cache.transfer.flush()
    return cache.poll()


def late_load(cache: HiRadixCache, tokens: list[int]) -> LoadTicket:
    """Load `tokens` from storage, and let the read time out while the service keeps it
    (its slots stay quarantined until `settle()`); returns the collected, failed ticket
    after unlocking what it kept."""
    store = storage_of(cache)
    store.hold = True
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None
    store.expire()
    store.hold = False
    assert ticket in step(cache) and not ticket.ok  # the load timed out for the engine
    release(cache, ticket)
    return ticket


def test_a_late_load_never_lands_in_a_reused_slot(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=4, with_storage=True)
    store = storage_of(cache)
    a, b = tokens_for(1, 2), tokens_for(5, 6)
    only_in_storage(cache, a, 10.0)
    late_load(cache, a)
    cache.check_integrity()
    # New pages need L2 slots while the service still reads a's pages into the old ones.
    b_node = put(cache, b, 50.0).handle.node
    step(cache)
    assert b_node.host is not None
    store.settle()  # the late read lands now
    cache.drain()
    cache.check_integrity()
    assert host_values(cache, b_node.host) == [50.0, 51.0], "a late read overwrote b's L2 copy"
    # b comes back from L2 to L1 with its own bytes.
    cache.evict(8)
    ticket = cache.load(cache.match(b))
    assert ticket is not None and ticket in cache.drain() and ticket.ok
    assert [float(cache.device_pool.tensor[p].flatten()[0]) for p in ticket.device_pages] == [
        50.0,
        51.0,
    ]
    release(cache, ticket)
    cache.check_integrity()


def test_a_late_store_never_reads_a_reused_slot(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=2, with_storage=True)
    store = storage_of(cache)
    a, b = tokens_for(1, 2), tokens_for(5, 6)
    store.hold = True
    put(cache, a, 10.0)
    step(cache)  # a's L2 copy landed; its store waits for a quiet engine (store_queue.py)
    cache.start_stores()  # now it goes to the (held) service
    assert store.ops, "no store was started"
    store.expire()
    store.hold = False
    step(cache)  # the store timed out for the engine
    cache.clear()
    put(cache, b, 50.0)  # wants L2 slots while the service still reads a's
    step(cache)
    cache.check_integrity()
    store.settle()  # the late store reads its slots now
    cache.drain()
    cache.check_integrity()
    hashes = chain_hashes(NS.digest(), a, PAGE)
    assert all(h in store.pages for h in hashes), "the late store did not run"
    assert [stored_value(store, h) for h in hashes] == [10.0, 11.0], (
        "a late store published another page's bytes under a's hashes"
    )


def test_quarantine_is_counted_and_released_by_settled(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8, with_storage=True)
    store = storage_of(cache)
    a = tokens_for(1, 2)
    only_in_storage(cache, a, 10.0)
    late_load(cache, a)
    stats = cache.stats()
    assert stats.quarantined_slots == 2 and stats.host is not None
    assert stats.host.in_use == 2 and stats.host.free == 6
    assert cache.evict_host(8) == 0 and cache.clear() == 0  # quarantine is not the tree's
    cache.check_integrity()
    store.settle()
    cache.drain()
    stats = cache.stats()
    assert stats.quarantined_slots == 0 and stats.host is not None and stats.host.free == 8
    assert stats.counters.slots_quarantined == 2 and stats.counters.settled_tickets == 1
    assert stats.counters.tickets_late == 1
    assert cache.lookup(a)["host"] == 0, "pages of a timed-out load were served"
    cache.check_integrity()


def test_storage_pauses_past_the_quarantine_cap(make_cache: MakeCache) -> None:
    # 8 slots, cap 25%: two quarantined slots stop new storage work.
    cache = make_cache(device_pages=16, host_slots=8, with_storage=True)
    store = storage_of(cache)
    a, b, c = tokens_for(1, 2), tokens_for(3, 4), tokens_for(5, 6)
    only_in_storage(cache, a, 10.0)
    only_in_storage(cache, b, 30.0)
    late_load(cache, a)
    assert cache.stats().quarantined_slots == 2
    # No new load from storage (recompute instead) and no new store.
    assert cache.match(b).storage_hit_pages == 0
    stores = store.stores
    put(cache, c, 50.0)
    cache.drain()
    assert store.stores == stores
    counters = cache.stats().counters
    assert counters.storage_loads_paused >= 1 and counters.storage_stores_paused >= 2
    store.settle()
    cache.drain()
    # Settled: storage work resumes.
    assert cache.match(b).storage_hit_pages == 2
    put(cache, tokens_for(7), 70.0)
    cache.drain()
    assert store.stores == stores + 1
    cache.check_integrity()


def test_quarantine_cap_is_a_validated_config_field_and_a_flag() -> None:
    assert CacheConfig(disk_cache_dir=None).max_quarantine_fraction == 0.25
    with pytest.raises(ValueError, match="--max-quarantine-fraction"):
        CacheConfig(disk_cache_dir=None, max_quarantine_fraction=1.5)
    args = build_parser().parse_args(["--device", "cpu", "--max-quarantine-fraction", "0.5"])
    assert to_config(args).cache.max_quarantine_fraction == 0.5
