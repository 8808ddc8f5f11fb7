"""Clearing L1/L2 by tier and tenant, pins in L2, `cache_store: false`, and the L1/L2 KV
events (residency.py) that a subscriber rebuilds the tiers from."""

from __future__ import annotations

import random

from cache_helpers import NS, PAGE, MakeCache, put, tokens_for

from asynchicache.common.keys import chain_hashes
from asynchicache.common.tiers import AllBlocksCleared, BlockRemoved, BlockStored, TierEvent
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pins import PinnedChain


def pin(cache: HiRadixCache, tokens: list[int], salt: str = "") -> PinnedChain:
    root = NS.with_salt(salt).digest() if salt else NS.digest()
    hashes = tuple(chain_hashes(root, tokens, PAGE))
    chain = PinnedChain(hashes[-1].hex(), hashes, None, salt)
    cache.pins.add(chain)
    return chain


def test_clear_by_tier_keeps_the_other_tier(make_cache: MakeCache) -> None:
    cache = make_cache()
    put(cache, tokens_for(1, 2, 3))
    cache.drain()
    done = cache.clear_tiers(device=True, host=False)
    assert done.tiers["device"].removed == 3 and "host" not in done.tiers
    cache.check_integrity()
    assert cache.lookup(tokens_for(1, 2, 3))["host"] == 3 * PAGE  # served from L2 now
    done = cache.clear_tiers(device=False, host=True)
    assert done.tiers["host"].removed == 3
    assert cache.stats().host.cached == 0 and not list(cache.tree.iter_nodes())  # type: ignore[union-attr]
    cache.check_integrity()


def test_clear_counts_pages_in_use_and_keeps_them(make_cache: MakeCache) -> None:
    cache = make_cache()
    put(cache, tokens_for(1, 2))
    held = put(cache, tokens_for(1, 2, 3), keep_lock=True)  # a running request's prefix
    put(cache, tokens_for(7))
    cache.drain()
    done = cache.clear_tiers()
    device, host = done.tiers["device"], done.tiers["host"]
    assert (device.removed, device.kept_in_use) == (1, 3)  # page 7 goes, 1-2-3 are locked
    assert (host.removed, host.kept_in_use) == (1, 3)
    cache.check_integrity()
    cache.unlock(held.handle)
    assert cache.clear() == 3 + 3


def test_clear_one_tenant_only(make_cache: MakeCache) -> None:
    cache = make_cache()
    tokens = tokens_for(1, 2)
    put(cache, tokens, salt="a")
    put(cache, tokens, salt="b")
    put(cache, tokens)
    cache.drain()
    done = cache.clear_tiers(salt="a")
    assert done.tiers["device"].removed == 2 and done.tiers["host"].removed == 2
    assert cache.lookup(tokens, salt="a")["device"] == 0
    assert cache.lookup(tokens, salt="b")["device"] == 2 * PAGE
    assert cache.lookup(tokens)["device"] == 2 * PAGE
    cache.check_integrity()


def test_pinned_pages_stay_in_l2_through_eviction_and_clear(make_cache: MakeCache) -> None:
    def workload(cache: HiRadixCache) -> None:
        for k in range(10, 30, 2):  # 20 pages through an L2 of 8 slots
            put(cache, tokens_for(k, k + 1))
            cache.drain()

    system = tokens_for(1, 2, 3)
    control = make_cache(device_pages=4, host_slots=8)
    put(control, system)
    control.drain()
    workload(control)
    assert control.lookup(system) == {"device": 0, "host": 0, "disk": 0, "remote": 0}

    cache = make_cache(device_pages=4, host_slots=8)
    put(cache, system)
    cache.drain()
    pin(cache, system[: 2 * PAGE])  # its first two pages; the third is not pinned
    cache.tree.split(cache.tree.match(system)[-1], 1)  # a pinned run in two nodes
    workload(cache)
    assert cache.lookup(system)["host"] == 2 * PAGE  # L1 evicted them, L2 kept them
    cache.check_integrity()
    done = cache.clear_tiers()
    assert done.tiers["host"].kept_pinned == 2 and cache.lookup(system)["host"] == 2 * PAGE
    done = cache.clear_tiers(include_pinned=True)
    assert done.tiers["host"].removed == 2 and cache.lookup(system)["host"] == 0
    cache.check_integrity()


def test_expired_and_removed_pins_stop_protecting(make_cache: MakeCache) -> None:
    now = [1000.0]
    cache = make_cache()
    cache.parts.pins._clock = lambda: now[0]  # a clock the test moves
    put(cache, tokens_for(1, 2))
    cache.drain()
    hashes = tuple(chain_hashes(NS.digest(), tokens_for(1, 2), PAGE))
    cache.pins.add(PinnedChain("p", hashes, expires_at=1010.0))
    assert cache.clear_tiers().tiers["host"].kept_pinned == 2
    now[0] = 1011.0
    assert cache.pins.num_pages == 0
    assert cache.clear_tiers().tiers["host"].removed == 2


def test_cache_store_false_keeps_pages_out_of_storage(make_cache: MakeCache) -> None:
    cache = make_cache(with_storage=True)
    storage = cache.storage
    private = tokens_for(1, 2)
    put(cache, private, store=False)
    cache.drain()
    assert cache.stats().host.cached == 2  # type: ignore[union-attr]  # in L1 and L2
    assert storage.pages == {}  # type: ignore[union-attr]
    put(cache, tokens_for(5, 6))  # an ordinary request is stored
    cache.drain()
    assert len(storage.pages) == 2  # type: ignore[union-attr]
    put(cache, private + tokens_for(3))  # a request that stores reuses the same pages
    cache.drain()
    assert len(storage.pages) == 5  # type: ignore[union-attr]
    cache.check_integrity()


class Subscriber:
    """A router's view: pages per tier, rebuilt from events only."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {"device": set(), "host": set()}
        self.removed = {"device": 0, "host": 0}

    def apply(self, events: list[TierEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                assert not set(e.block_hashes) & self.tiers[e.tier], "stored twice"
                self.tiers[e.tier] |= set(e.block_hashes)
                assert len(e.token_ids) == PAGE * len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.tiers[e.tier], "removed what was not there"
                self.tiers[e.tier] -= set(e.block_hashes)
                self.removed[e.tier] += len(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.tiers[e.tier].clear()


def test_residency_events_rebuild_l1_and_l2(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=6, host_slots=8)
    residency = cache.residency()
    sub = Subscriber()
    rng = random.Random(5)
    for step in range(60):
        first = rng.randrange(8)
        tokens = tokens_for(*range(first, first + rng.randrange(1, 4)))
        action = rng.random()
        if action < 0.7:
            cache.drain()  # write-throughs in flight hold their L1 pages
            put(cache, tokens, salt=rng.choice(["", "t"]))
        elif action < 0.8:
            cache.clear_tiers(device=rng.random() < 0.5, host=True)
        else:
            m = cache.match(tokens)
            cache.lock(m.handle)
            ticket = cache.load(m)
            done = cache.drain()
            if ticket is not None:
                assert ticket in done and ticket.handle is not None
                cache.unlock(ticket.handle)
            cache.unlock(m.handle)
        if step % 3 == 0:
            cache.drain()
            sub.apply(residency.changes())
            stats = cache.stats()
            assert len(sub.tiers["device"]) == stats.device.cached
            assert len(sub.tiers["host"]) == stats.host.cached  # type: ignore[union-attr]
    assert min(sub.removed.values()) > 5 and min(map(len, sub.tiers.values())) > 0, sub.removed
    late = Subscriber()
    late.apply(residency.snapshot())
    assert late.tiers == sub.tiers
    assert residency.changes() == []  # nothing changed since
