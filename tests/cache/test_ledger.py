"""The page ledger: lowest pages first, transitions from the table only, strict or counted."""

from __future__ import annotations

import itertools
import logging

import pytest
from cache_helpers import PAGE, MakeCache, tokens_for

from asynchicache.hierarchy.l2.ledger import (
    PAGE_TRANSITIONS,
    SLOT_TRANSITIONS,
    LedgerError,
    PageState,
    SlotState,
    device_ledger,
    host_ledger,
)


def test_take_hands_out_the_lowest_free_pages_and_counts() -> None:
    ledger = device_ledger(8, strict=True, on_illegal=lambda m: None)
    assert ledger.take(3, PageState.PRIVATE) == [0, 1, 2]
    assert ledger.take(2, PageState.FILLING) == [3, 4]
    ledger.move([1, 0], PageState.PRIVATE, PageState.FREE)
    assert ledger.num_free == 5
    assert ledger.take(3, PageState.PRIVATE) == [0, 1, 5]
    assert ledger.take(3, PageState.PRIVATE) is None  # two free: nothing changes
    assert ledger.counts() == {"free": 2, "private": 4, "cached": 0, "filling": 2}
    assert ledger.take(0, PageState.PRIVATE) == []
    assert ledger.problems() == []


def test_every_transition_outside_the_table_raises_in_strict_mode() -> None:
    for make, states, table in (
        (device_ledger, PageState, PAGE_TRANSITIONS),
        (host_ledger, SlotState, SLOT_TRANSITIONS),
    ):
        for src in states:
            for dst in states:
                ledger = make(2, True, lambda m: None)
                if src != states(0):
                    path = _path_to(src, table)
                    ledger.take(1, path[0])
                    for a, b in itertools.pairwise(path):
                        ledger.move([0], a, b)
                assert ledger.state(0) == src
                legal = src != states(0) and dst in table[src]
                if legal:
                    ledger.move([0], src, dst)
                    assert ledger.state(0) == dst
                else:
                    with pytest.raises(LedgerError):
                        ledger.move([0], src, dst)
                    assert ledger.state(0) == src  # refused: nothing changed


def _path_to(target: object, table: dict) -> list:
    """States from a FREE -> x transition to `target` along the table (breadth first)."""
    free = next(iter(table))
    paths = [[s] for s in table[free]]
    while paths:
        path = paths.pop(0)
        if path[-1] == target:
            return path
        paths += [[*path, n] for n in table.get(path[-1], ()) if n not in path and n != free]
    raise AssertionError(f"{target} unreachable")


def test_a_slot_under_storage_work_is_never_freed() -> None:
    ledger = host_ledger(4, strict=True, on_illegal=lambda m: None)
    loading = ledger.take(2, SlotState.LOADING)
    assert loading == [0, 1]
    ledger.move(loading, SlotState.LOADING, SlotState.LOAD_QUARANTINED)
    with pytest.raises(LedgerError, match="LOAD_QUARANTINED"):
        ledger.move(loading, (SlotState.READY, SlotState.STORED), SlotState.FREE)
    assert ledger.take(3, SlotState.WRITING) is None  # two free slots only
    storing = ledger.take(1, SlotState.WRITING)
    assert storing is not None
    ledger.move(storing, SlotState.WRITING, SlotState.READY)
    ledger.move(storing, SlotState.READY, SlotState.STORING)
    ledger.move(storing, SlotState.STORING, SlotState.STORE_QUARANTINED)
    with pytest.raises(LedgerError):  # Settled returns it to READY first
        ledger.move(storing, SlotState.STORE_QUARANTINED, SlotState.FREE)


def test_without_strict_an_illegal_change_is_refused_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []
    ledger = host_ledger(4, strict=False, on_illegal=seen.append)
    slots = ledger.take(2, SlotState.LOADING)
    assert slots is not None
    with caplog.at_level(logging.ERROR):
        ledger.move([slots[0], 3], SlotState.LOADING, SlotState.FREE)  # slot 3 is free already
    assert ledger.state(slots[0]) == SlotState.FREE  # the legal part happened
    assert ledger.state(3) == SlotState.FREE and ledger.num_free == 3
    assert ledger.illegal == 1 and len(seen) == 1 and "3" in seen[0]
    assert "illegal transition" in caplog.text
    ledger.move([slots[1], slots[1]], SlotState.LOADING, SlotState.STORED)  # repeated page
    assert ledger.illegal == 2
    assert ledger.problems() == []


def test_the_cache_counts_illegal_transitions_in_its_stats(make_cache: MakeCache) -> None:
    cache = make_cache(strict=False)
    pages = cache.allocate(2)
    assert pages is not None
    cache.unlock(cache.insert(tokens_for(1, 2), pages).handle)
    cache.drain()
    cache.parts.device.move(pages, PageState.PRIVATE, PageState.FREE)  # a bug elsewhere
    assert cache.stats().counters.illegal_transitions == 1
    assert cache.lookup(tokens_for(1, 2))["device"] == 2 * PAGE  # refused: still cached
    cache.check_integrity()


def test_stats_count_pages_by_ledger_state(make_cache: MakeCache) -> None:
    cache = make_cache(device_pages=8, host_slots=4)
    mine = cache.allocate(1)
    pages = cache.allocate(2)
    assert mine is not None and pages is not None
    cache.unlock(cache.insert(tokens_for(1, 2), pages).handle)
    cache.drain()
    stats = cache.stats()
    assert stats.page_states == {"free": 5, "private": 1, "cached": 2, "filling": 0}
    assert stats.slot_states["ready"] == 2 and stats.slot_states["free"] == 2
    assert stats.quarantined_slots == 0
    cache.free(mine)
