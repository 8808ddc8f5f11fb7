"""Stores of new pages wait for a quiet engine (hierarchy/l2/store_queue.py): idle for IDLE_S, or at
most MAX_WAIT_S under continuous work; meanwhile L2 keeps their copies, and drain, clear and
close start them at once; so do L2 pressure (held pages past MAX_HELD_FRACTION of L2) and an
L1 -> L2 write that found no room."""

from __future__ import annotations

import time

from cache_helpers import MakeCache, put, storage_of, tokens_for

from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.hierarchy.l2.store_queue import IDLE_S, MAX_HELD_FRACTION, MAX_WAIT_S, StoreQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _landed(cache: HiRadixCache) -> None:
    """Poll (busy) until the L1 -> L2 copies landed: their stores are queued then."""
    deadline = time.monotonic() + 10
    while cache.parts.transfers and time.monotonic() < deadline:
        cache.poll()
    assert not cache.parts.transfers


def test_the_queue_starts_stores_after_idle_s_or_max_wait_s() -> None:
    clock = Clock()
    queue = StoreQueue(clock)
    a, b = object(), object()
    queue.add(a, (1,))  # type: ignore[arg-type]
    assert queue.due(idle=True, l2_slots=100) == []  # idle from now on...
    clock.now += IDLE_S / 2
    assert queue.due(idle=True, l2_slots=100) == []  # ...but not for long enough
    assert queue.due(idle=False, l2_slots=100) == []  # work came: the quiet moment starts again
    queue.add(b, (2,))  # type: ignore[arg-type]
    clock.now += IDLE_S / 2
    assert queue.due(idle=True, l2_slots=100) == []
    clock.now += IDLE_S * 1.5
    assert [w.deepest for w in queue.due(idle=True, l2_slots=100)] == [a, b] and len(queue) == 0
    queue.add(a, (3,))  # type: ignore[arg-type]
    assert queue.due(idle=False, l2_slots=100) == []
    clock.now += MAX_WAIT_S * 0.9
    assert queue.due(idle=False, l2_slots=100) == []
    clock.now += MAX_WAIT_S * 0.2
    assert [w.slots for w in queue.due(idle=False, l2_slots=100)] == [(3,)]  # waited long enough


def test_a_new_prompts_store_waits_for_a_quiet_engine_and_l2_keeps_its_pages(
    make_cache: MakeCache,
) -> None:
    cache = make_cache(device_pages=8, host_slots=16, with_storage=True)
    store = storage_of(cache)
    tokens = tokens_for(1, 2)
    put(cache, tokens, value=10.0)
    _landed(cache)
    assert store.stores == 0 and cache.pending == 1  # one store waiting
    assert cache.evict_host(4) == 0  # held: L2 cannot drop a page before it is stored
    cache.check_integrity()
    start = time.monotonic()
    while not store.ops and time.monotonic() - start < 5:
        cache.poll(idle=True)
    assert IDLE_S <= time.monotonic() - start < MAX_WAIT_S
    node = cache.match(tokens).handle.node
    assert node.host is not None
    assert {cache.parts.host.state(s) for s in node.host} == {SlotState.STORING}
    cache.drain()
    assert store.stores == 2 and cache.stats().counters.host_to_storage_pages == 2
    cache.check_integrity()


def test_under_continuous_work_a_store_starts_within_max_wait(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=16, with_storage=True)
    store = storage_of(cache)
    put(cache, tokens_for(3, 4), value=20.0)
    _landed(cache)
    start = time.monotonic()
    while not store.ops and time.monotonic() - start < 5:
        cache.poll(idle=False)  # the engine never goes quiet
        time.sleep(0.005)
    assert MAX_WAIT_S <= time.monotonic() - start < MAX_WAIT_S + 1.0
    cache.drain()
    assert store.stores == 2
    cache.check_integrity()


def test_drain_clear_and_close_start_waiting_stores(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=8, with_storage=True)
    store = storage_of(cache)
    put(cache, tokens_for(5, 6), value=30.0)
    _landed(cache)
    cache.drain()  # does not wait for a quiet moment
    assert store.stores == 2 and cache.pending == 0
    submitted = store.next_ticket
    put(cache, tokens_for(7), value=40.0)
    _landed(cache)
    cache.clear()  # the store starts (and holds L2) as if it had not waited
    assert store.next_ticket == submitted + 1
    put(cache, tokens_for(8), value=50.0)
    _landed(cache)
    cache.close()
    assert store.next_ticket == submitted + 2


def test_held_pages_past_the_fraction_of_l2_start_at_once() -> None:
    queue = StoreQueue(Clock())
    a, b = object(), object()
    l2 = 40
    queue.add(a, tuple(range(int(MAX_HELD_FRACTION * l2))))  # type: ignore[arg-type]
    assert queue.due(idle=False, l2_slots=l2) == []  # at the fraction: still waits
    queue.add(b, (99,))  # type: ignore[arg-type]
    assert [w.deepest for w in queue.due(idle=False, l2_slots=l2)] == [a, b]
    assert queue.held_slots == 0


def test_back_to_back_prompts_reach_storage_though_l2_is_small(make_cache: MakeCache) -> None:
    """A busy engine finishing prompt after prompt: every prompt's pages are stored (the
    waiting stores gave L2 back instead of holding it until the next quiet moment)."""
    cache = make_cache(device_pages=8, host_slots=6, with_storage=True)
    store = storage_of(cache)
    for k in range(6):
        put(cache, tokens_for(20 + 2 * k, 21 + 2 * k), value=60.0 + k)
        _landed(cache)
        for _ in range(50):  # a few busy steps, far less than MAX_WAIT_S
            cache.poll(idle=False)
    cache.drain()
    assert cache.stats().counters.writes_skipped == 0
    assert store.stores == 12
    cache.check_integrity()
