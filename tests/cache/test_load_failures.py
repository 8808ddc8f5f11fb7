"""A load always finishes, even when its own completion handling fails (issue 11, defect 5)."""

from __future__ import annotations

import pytest
from cache_helpers import PAGE, MakeCache, put, release, tokens_for

from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.ledger import SlotState


def assert_idle_and_unlocked(cache: HiRadixCache) -> None:
    cache.check_integrity()
    stats = cache.stats()
    assert stats.device.in_use == 0, "L1 pages of the load leaked"
    assert stats.host is not None and stats.host.in_use == 0, "L2 slots of the load leaked"
    for node in cache.tree.iter_nodes():
        assert node.lock_ref == 0, f"lock left at {node}"


def test_a_failing_storage_completion_finishes_the_load_with_an_error(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(with_storage=True)
    tokens = tokens_for(1, 2, 3)
    put(cache, tokens, 10.0)
    cache.drain()
    cache.clear()
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(cache.tree, "insert", broken)
    done = cache.drain()
    monkeypatch.undo()
    assert ticket in done and ticket.done, "the load never finished"
    assert not ticket.ok and ticket.error is not None and "injected" in ticket.error
    release(cache, ticket)
    assert_idle_and_unlocked(cache)
    # The cache still works: the same prefix loads now.
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None and ticket in cache.drain() and ticket.ok
    release(cache, ticket)
    assert_idle_and_unlocked(cache)


def test_a_failing_fill_completion_finishes_the_load_with_an_error(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache()
    tokens = tokens_for(1, 2, 3)
    put(cache, tokens, 10.0)
    cache.drain()
    cache.evict(8)  # only in L2 now
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None
    cache.transfer.flush()
    real_path = cache.tree.path

    def broken_once(node):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(cache.tree, "path", real_path)  # only the first call fails
        raise RuntimeError("injected failure")

    monkeypatch.setattr(cache.tree, "path", broken_once)
    done = cache.poll()
    done += cache.drain()
    assert ticket in done and ticket.done, "the load never finished"
    assert not ticket.ok and ticket.error is not None and "injected" in ticket.error
    release(cache, ticket)
    assert_idle_and_unlocked(cache)


def test_a_chain_longer_than_l2_room_loads_the_prefix_that_fits(make_cache: MakeCache) -> None:
    """With L2 room for only part of a stored chain (here another load holds half of L2),
    the load reads the prefix that fits: a restart with a small L2 used to read nothing
    ("no L2 room for the storage pages")."""
    cache = make_cache(device_pages=8, host_slots=4, with_storage=True)
    tokens = tokens_for(1, 2, 3, 4)
    put(cache, tokens, 10.0)
    cache.drain()
    cache.clear()
    match = cache.match(tokens)
    assert match.storage_hit_pages == 4
    held = cache.parts.host.take(2, SlotState.LOADING)  # another load's slots
    assert held is not None
    ticket = cache.load(match)
    assert ticket is not None and ticket in cache.drain()
    assert ticket.pages_from_storage == 2, ticket.error
    assert ticket.handle is not None
    assert cache.lookup(tokens)["device"] == 2 * PAGE
    cache.unlock(ticket.handle)
    cache.parts.host.move(held, SlotState.LOADING, SlotState.FREE)
    assert_idle_and_unlocked(cache)
