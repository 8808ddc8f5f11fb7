"""cache_salt: tenants never share a cached page, in any tier."""

from __future__ import annotations

from cache_helpers import NS, PAGE, MakeCache, MemoryStorage, tokens_for

from asynchicache.common.keys import page_hashes


def _insert(cache, tokens: list[int], salt: str) -> list[int]:  # type: ignore[no-untyped-def]
    pages = cache.allocate(len(tokens) // PAGE)
    assert pages is not None
    result = cache.insert(tokens, pages, salt=salt)
    cache.unlock(result.handle)
    cache.check_integrity()
    return result.device_pages


def test_a_salted_prefix_is_invisible_to_other_salts(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8)
    tokens = tokens_for(1, 2, 3)
    _insert(cache, tokens, "tenant-a")
    assert len(cache.match(tokens, salt="tenant-a").device_pages) == 3
    for other in ("tenant-b", ""):
        m = cache.match(tokens, salt=other)
        assert (len(m.device_pages), m.host_hit_pages) == (0, 0)
        assert cache.lookup(tokens, salt=other) == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert cache.lookup(tokens, salt="tenant-a")["device"] == 3 * PAGE


def test_same_tokens_under_two_salts_are_two_copies(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8)
    tokens = tokens_for(1, 2)
    a = _insert(cache, tokens, "tenant-a")
    b = _insert(cache, tokens, "tenant-b")
    assert not set(a) & set(b)
    assert cache.stats().device.cached == 4
    cache.drain()  # write-through copies hold their nodes until they land
    cache.evict(8)  # eviction sees every tenant's pages
    assert cache.stats().device.cached == 0
    cache.check_integrity()


def test_salted_pages_reach_storage_under_salted_hashes(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8, with_storage=True)
    storage = cache.storage
    assert isinstance(storage, MemoryStorage)
    tokens = tokens_for(4, 5)
    _insert(cache, tokens, "tenant-a")
    cache.drain()
    salted = page_hashes(NS.with_salt("tenant-a"), tokens)
    assert storage.exists(salted) == 2
    assert storage.exists(page_hashes(NS, tokens)) == 0
    cache.evict(8)
    cache.evict_host(8)
    assert cache.match(tokens, salt="tenant-b").storage_hit_pages == 0
    assert cache.match(tokens, salt="tenant-a").storage_hit_pages == 2


# -- issue 39, finding 6: a salt costs memory only while it holds pages ----------------------


def test_a_salts_root_goes_with_its_last_page(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8)
    tokens = tokens_for(1, 2)
    _insert(cache, tokens, "tenant-a")
    assert len(cache.tree.roots()) == 2
    cache.drain()
    cache.evict(8)
    cache.evict_host(8)
    cache.check_integrity()
    assert len(cache.tree.roots()) == 1  # only the unsalted root stays
    _insert(cache, tokens, "tenant-a")  # the salt comes back: a fresh root, same chain
    assert len(cache.match(tokens, salt="tenant-a").device_pages) == 2


def test_looking_up_a_salt_leaves_no_root(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8)
    tokens = tokens_for(1, 2)
    for i in range(50):
        cache.match(tokens, salt=f"probe-{i}")
        cache.lookup(tokens, salt=f"look-{i}")
    cache.poll()
    assert len(cache.tree.roots()) == 1
    cache.check_integrity()


def test_a_locked_empty_root_stays_until_unlocked(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8)
    m = cache.match(tokens_for(1), salt="waiting")  # nothing cached: the root's handle
    cache.lock(m.handle)
    cache.poll()
    assert len(cache.tree.roots()) == 2
    cache.unlock(m.handle)
    cache.poll()
    assert len(cache.tree.roots()) == 1


def test_memory_per_salt_is_bounded_over_100k_salts() -> None:
    """100,000 distinct salts, each caching a page later evicted, and as many only looked
    up: the tree ends with the roots of the salts still holding pages, and no Python
    object of the others survives (the tree itself: the cache-level tests above show that
    eviction and `poll` reach it)."""
    import gc

    from asynchicache.common.tiers import Tier
    from asynchicache.hierarchy.node import RadixNode
    from asynchicache.hierarchy.radix import RadixTree

    tree = RadixTree(PAGE, NS.digest())
    tokens = tokens_for(1)
    live: list[RadixNode] = []
    gc.collect()
    base = len(gc.get_objects())
    for i in range(100_000):
        root = tree.root_for(f"s{i:06d}", lambda i=i: i.to_bytes(16, "little"))
        live.append(tree.insert(tokens, [i], Tier.DEVICE, start=root).node)
        tree.root_for(f"probe{i:06d}", lambda: b"\0" * 16)  # a salt only looked up
        if len(live) > 8:  # evict the oldest salt's page
            tree.remove_subtree(live.pop(0))
        if i % 64 == 0:
            tree.drop_idle_roots()
    tree.drop_idle_roots()
    gc.collect()
    assert len(tree.roots()) == 1 + 8  # the unsalted root and the salts still holding pages
    grown = len(gc.get_objects()) - base
    assert grown < 1000, f"{grown} more live objects after 100,000 salts"
