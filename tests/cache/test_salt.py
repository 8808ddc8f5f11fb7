"""cache_salt: tenants never share a cached page, in any tier."""

from __future__ import annotations

from cache_helpers import NS, PAGE, MakeCache, MemoryStorage, tokens_for

from asynchicache.cache.keys import page_hashes


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
