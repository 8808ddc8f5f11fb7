"""The connector's L2 ledger: states, pins, LRU eviction (prefix kept last), integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynchicache.hierarchy.l2.host_index import HostIndex
from asynchicache.hierarchy.l2.ledger import SlotState


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_publish_pin_and_evict_unread_pages_oldest_first_keeping_prefixes() -> None:
    index = HostIndex(4)
    chain = index.allocate(3)
    assert chain == [0, 1, 2]
    for i, slot in enumerate(chain):
        assert index.publish(slot, h(i))
    assert index.leading([h(0), h(1), h(2), h(9)]) == [0, 1, 2]
    index.add_readers(chain)  # a reader touches the chain suffix-first: its prefix ends newest
    index.drop_readers(chain)
    # 3 more slots: one free, two evicted; the chain's suffix goes before its prefix.
    got = index.allocate(3)
    assert got is not None and sorted(got) == [1, 2, 3]
    assert index.slot_of(h(0)) == 0 and index.slot_of(h(2)) is None
    index.check_integrity()


def test_pinned_and_writing_slots_are_never_evicted() -> None:
    index = HostIndex(2)
    a, b = index.allocate(2)  # type: ignore[misc]
    index.publish(a, h(1))
    index.add_readers([a])
    assert index.allocate(1) is None  # a is read, b is being written
    assert index.use(b) is SlotState.WRITING
    index.drop_readers([a])
    assert index.allocate(1) == [a]
    index.check_integrity()


def test_a_duplicate_page_frees_its_slot_and_bad_transitions_raise() -> None:
    index = HostIndex(3)
    a, b = index.allocate(2)  # type: ignore[misc]
    assert index.publish(a, h(5))
    assert not index.publish(b, h(5))
    assert index.use(b) is SlotState.FREE
    with pytest.raises(ValueError):
        index.release([a])  # READY, not WRITING
    with pytest.raises(ValueError):
        index.drop_readers([a])  # no reader
    with pytest.raises(ValueError):
        index.add_readers([b])  # FREE
    index.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("apcurxlqs"), st.integers(0, 7)), max_size=60))
def test_any_sequence_of_operations_keeps_the_ledger_whole(ops: list[tuple[str, int]]) -> None:
    index = HostIndex(6)
    writing: list[int] = []  # WRITING (save copies): published or released later
    loading: list[int] = []  # LOADING: a read in flight (may end quarantined)
    quarantined: list[int] = []
    pinned: list[int] = []
    for op, n in ops:
        if op == "a":
            got = index.allocate(n % 4)
            writing += got or []
        elif op == "l":
            got = index.allocate(n % 4, SlotState.LOADING)
            loading += got or []
        elif op == "q" and loading:  # a read ended unsettled
            index.quarantine([loading[0]])
            quarantined.append(loading.pop(0))
        elif op == "s" and quarantined:  # its Settled
            index.release([quarantined.pop()])
        elif op == "p" and loading and n % 2:
            index.publish(loading.pop(0), h(n))
        elif op == "p" and writing:
            index.publish(writing.pop(0), h(n))
        elif op == "r" and writing:
            index.release([writing.pop()])
        elif op == "c":
            slots = index.leading([h(n)])
            index.add_readers(slots)
            pinned += slots
        elif op == "u" and pinned:
            index.drop_readers([pinned.pop()])
        elif op == "x":
            room = index.room()
            got = index.allocate(1)  # may evict; may fail
            assert (got is not None) == (room >= 1)  # room() counts what allocate can take
        index.check_integrity()
        for slot in pinned:
            assert index.use(slot) is SlotState.READY
        for slot in quarantined:
            assert index.use(slot) is SlotState.LOAD_QUARANTINED
        assert index.counts()["quarantined"] == len(quarantined)
