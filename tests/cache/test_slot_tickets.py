"""`SlotTickets`, the L2 ticket lifecycle our hierarchy and the vLLM connector share: what
a Completion does to a ticket's slots, given-up loads, and the quarantine until Settled.
(tests/vllm/test_l2_lifecycle.py drives both users of it through a real service.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asynchicache.hierarchy.l2.slot_tickets import ReadEnd, SlotTickets, StoreEnd
from asynchicache.storage.base import Completion, Settled, TicketKind

LOAD, STORE = TicketKind.LOAD, TicketKind.STORE


def test_a_settled_read_lands_its_leading_pages_and_frees_the_rest() -> None:
    book: SlotTickets[str, None] = SlotTickets()
    book.add(1, "job")
    assert book.take(1) == "job" and book.take(1) is None and len(book) == 0
    end = book.read_done(Completion(1, LOAD, 2, 4, "short"), [7, 3, 5, 6])
    assert end == ReadEnd(landed=[7, 3], empty=[5, 6], quarantined=[])
    assert not book.unsettled


@given(st.integers(-3, 9), st.integers(0, 6))
def test_a_read_never_lands_more_than_its_slots(pages_ok: int, n: int) -> None:
    book: SlotTickets[str, None] = SlotTickets()
    end = book.read_done(Completion(1, LOAD, pages_ok, n), list(range(n)))
    assert end.landed + end.empty == list(range(n)) and not end.quarantined
    assert len(end.landed) == max(0, min(pages_ok, n))


def test_an_unsettled_read_lands_nothing_and_quarantines_every_slot_until_settled() -> None:
    book: SlotTickets[str, None] = SlotTickets()
    book.add(1, "timed out")
    book.add(2, "given up")
    assert book.give_up(2) and not book.give_up(3)  # 3 is not open
    for ticket in (1, 2):
        book.take(ticket)
    late = book.read_done(Completion(1, LOAD, 2, 2, "timeout", settled=False), [0, 1])
    cancelled = book.read_done(Completion(2, LOAD, 0, 2, "cancelled", settled=False), [2, 3])
    assert (late.landed, late.empty, late.quarantined) == ([], [], [0, 1])
    assert not late.settled and late.late  # a timeout nobody asked for
    assert cancelled.quarantined == [2, 3] and not cancelled.late  # its requester gave up
    assert sorted(book.quarantined(LOAD)) == [0, 1, 2, 3] and book.quarantined(STORE) == []
    record = book.settle(Settled(2, "late reply"))
    assert record is not None and (record.kind, record.slots) == (LOAD, [2, 3])
    assert book.settle(Settled(2, "late reply")) is None  # once
    assert book.quarantined() == [0, 1]


def test_a_store_is_stored_only_whole_and_held_while_unsettled() -> None:
    book: SlotTickets[str, str] = SlotTickets()
    assert book.store_done(Completion(1, STORE, 2, 2), [0, 1]) == StoreEnd(True, False)
    assert book.store_done(Completion(2, STORE, 1, 2, "1 of 2"), [0, 1]) == StoreEnd(False, False)
    end = book.store_done(Completion(3, STORE, 0, 2, "timeout", settled=False), [4, 5], "node")
    assert end == StoreEnd(stored=False, quarantined=True)
    record = book.settle(Settled(3, "service exited"))
    assert record is not None
    assert (record.kind, record.slots, record.hold) == (STORE, [4, 5], "node")


def test_a_ticket_is_booked_once() -> None:
    book: SlotTickets[str, None] = SlotTickets()
    book.add(1, "a")
    with pytest.raises(ValueError, match="booked already"):
        book.add(1, "b")
    book.take(1)
    book.read_done(Completion(1, LOAD, 0, 1, "timeout", settled=False), [0])
    with pytest.raises(ValueError, match="booked already"):
        book.add(1, "c")  # still quarantined under that number
