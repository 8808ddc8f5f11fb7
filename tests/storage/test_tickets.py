"""Ticket lifetimes (`TicketBook`), process liveness, deadlines and private page copies."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import Pool, new_hashes, refs

from asynchicache.common.deadline import Deadline
from asynchicache.common.liveness import ProcessIdentity
from asynchicache.storage.base import Completion, Settled, TicketKind
from asynchicache.storage.client.tickets import OpenTicket, TicketBook
from asynchicache.storage.write_behind import stage

ME = ProcessIdentity.of(os.getpid())


def _book(*tickets: int, service: ProcessIdentity | None = ME) -> TicketBook:
    book = TicketBook()
    for t in tickets:
        book.add(
            t, OpenTicket(TicketKind.LOAD, 2, give_up_at=t * 10.0, request=None, service=service)
        )
    return book


def test_a_reply_completes_settled() -> None:
    book = _book(1)
    book.answered(1, 2, None)
    assert book.events == [Completion(1, TicketKind.LOAD, 2, 2, None, 0, settled=True)]
    assert not book.open and not book.quarantined


def test_a_timeout_quarantines_until_the_late_reply() -> None:
    book = _book(1, 2)
    assert book.overdue(15.0) == [1]
    assert book.give_up(1, "timed out")
    assert not book.give_up(1, "timed out")  # once
    book.answered(1, 2, None)  # late
    book.answered(1, 2, None)  # a duplicate: nothing more
    assert book.events == [
        Completion(1, TicketKind.LOAD, 0, 2, "timed out", 0, settled=False),
        Settled(1, "late reply"),
    ]
    assert book.counters["settled_late_reply"] == 1 and list(book.open) == [2]


def test_a_disconnect_settles_at_once_only_when_the_service_is_gone() -> None:
    dead = _dead_identity()
    book = _book(1, service=dead)
    book.add(2, OpenTicket(TicketKind.STORE, 1, 99.0, None, ME))
    book.give_up(2, "cancelled")
    book.disconnected()
    assert book.events[-1] == Completion(
        1, TicketKind.LOAD, 0, 2, "cache service disconnected", 0, settled=True
    )
    assert list(book.quarantined) == [2] and book.has_orphans
    book.settle_exited()  # ME is alive: still quarantined
    assert list(book.quarantined) == [2]
    assert book.orphans_of(ME) == [2]  # reconnected to the same service: ask it
    book.settle(2, "cancel acknowledged")
    assert book.events[-1] == Settled(2, "cancel acknowledged") and not book.quarantined


def test_orphans_of_a_dead_service_settle() -> None:
    book = _book(1, service=_dead_identity())
    book.give_up(1, "timed out")
    book.disconnected()
    book.settle_exited()
    assert book.events[-1] == Settled(1, "service exited")


def test_tickets_sent_before_registration_learn_their_service() -> None:
    book = _book(1, 2, service=None)
    book.give_up(2, "timed out")
    book.identify(ME)
    assert book.open[1].service == ME and book.quarantined[2].service == ME


@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from("rgcds")), max_size=60))
@settings(max_examples=200, deadline=None)
def test_one_completion_then_at_most_one_settled_per_ticket(ops: list[tuple[int, str]]) -> None:
    book = _book(*range(6))
    for ticket, op in ops:
        if op == "r":
            book.answered(ticket, 1, None)
        elif op == "g":
            book.give_up(ticket, "timed out")
        elif op == "c":
            book.settle(ticket, "cancel acknowledged")
        elif op == "d":
            book.disconnected()
        else:
            book.settle_all("client closed")
    for ticket in range(6):
        mine = [e for e in book.events if e.ticket == ticket]
        assert len(mine) <= 2
        if mine:
            assert isinstance(mine[0], Completion)
            unsettled = not mine[0].settled
            assert (len(mine) == 2) <= unsettled and all(isinstance(e, Settled) for e in mine[1:])
            assert (ticket in book.quarantined) == (unsettled and len(mine) == 1)
        else:
            assert ticket in book.open


def _dead_identity() -> ProcessIdentity:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = ProcessIdentity.of(proc.pid)
    proc.wait()
    return identity


def test_liveness_sees_zombies_and_reused_pids() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import os; os._exit(0)"])
    identity = ProcessIdentity.of(proc.pid)
    deadline = time.monotonic() + 10
    while identity.alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # exits, stays a zombie until we reap it
    assert not identity.alive() and os.path.exists(f"/proc/{proc.pid}")
    proc.wait()
    assert not identity.alive()
    assert ME.alive()
    other = ProcessIdentity(os.getppid(), ProcessIdentity.of(os.getppid()).start_ticks)
    assert other.alive()
    reused = ProcessIdentity(os.getppid(), (other.start_ticks or 0) + 1)  # same pid, other start
    assert not reused.alive()


def test_deadline() -> None:
    assert not Deadline().passed() and Deadline().left_s() is None
    assert Deadline(time.monotonic_ns() - 1).passed()
    later = Deadline.after(60)
    assert not later.passed() and 59 < (later.left_s() or 0) <= 60
    later.cancel()
    assert later.passed() and later.cancelled and later.left_s() == 0.0


def test_stage_copies_up_to_the_deadline(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(8, fill=8, seed=2)
    pages = refs(new_hashes(4), [3, 1, 2, 0])
    staged = stage(pages, pool.array)
    try:
        assert [r.slot for r in staged.refs] == [0, 1, 2, 3]
        assert np.array_equal(staged.pool, pool.array[[3, 1, 2, 0]])
        pool.array[:] = 0  # the slots change: the copy does not
        assert staged.pool.any()
        assert staged.copy_to(pool.array, [4, 5, 6, 7], None) == 4
        assert np.array_equal(pool.array[4:8], staged.pool)
        stopped = Deadline()
        stopped.cancel()
        assert staged.copy_to(pool.array, [0, 1], stopped) == 0
    finally:
        staged.release()
    cancelled = Deadline()
    cancelled.cancel()
    none = stage(pages, pool.array, cancelled)
    assert none.refs == [] and none.nbytes == 0
    none.release()


@pytest.mark.parametrize("n", [0, 1])
def test_stage_of_nothing_or_one(make_pool: Callable[..., Pool], n: int) -> None:
    pool = make_pool(2)
    staged = stage(refs(new_hashes(n), range(n)), pool.array)
    assert len(staged.refs) == n and staged.nbytes == n * pool.layout.page_bytes
    staged.release()
