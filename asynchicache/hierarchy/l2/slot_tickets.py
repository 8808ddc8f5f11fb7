"""`SlotTickets`: storage tickets over L2 slots, as the slots' owner sees them, written once.

Every user of an L2 pool hands storage work to the cache service as tickets
whose pages live in its slots: our hierarchy (loads.py, writes.py,
finished_tickets.py) and the vLLM connector (integrations/vllm/l2/host_tier.py).
The client's side of a ticket is `storage.client.tickets`; this is the side of
whoever owns the slots, and both users go through it:

    add(ticket, job)                          booked when submitted
    give_up(ticket)                           the requester stops waiting (a cancel follows)
    take(ticket) -> job                       its Completion arrived: the job leaves the book
    read_done(completion, slots) -> ReadEnd   a load's slots: landed / empty / quarantined
    store_done(completion, slots) -> StoreEnd a store's slots: stored / not / quarantined
    settle(settled) -> Unsettled              the service touches them no more

Rules (the pitfall DESIGN.md names: freeing a buffer the worker may still write):

* a settled load's leading `pages_ok` slots landed (read and verified: the owner
  adopts or publishes them); the rest stayed empty and are free at once;
* an unsettled Completion (the client gave up: a timeout, a cancel, a dropped
  connection) lands nothing: every slot of the ticket is quarantined, neither
  read nor reused, until the ticket's `Settled`; a store's slots stay held with
  their bytes unchanged, so the late store reads what it was given;
* a load given up by its requester may still land: what lands settled is kept in
  L2 for later requests (nobody waits for it); one that ends unsettled is not
  `late` (it was cancelled), while an unsettled ticket nobody gave up is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from asynchicache.storage.base import Completion, Settled, TicketKind

J = TypeVar("J")  # the owner's record of a ticket's work
H = TypeVar("H")  # what the owner holds for quarantined slots until Settled


@dataclass(eq=False)
class Unsettled(Generic[H]):
    """Slots of a ticket that ended unsettled: the service may still touch them.

    Load slots belong to nobody and are freed at `Settled`; store slots keep their
    bytes (and `hold`, whatever the owner keeps for them, e.g. a tree node's L2 hold).
    """

    kind: TicketKind
    slots: list[int]
    hold: H | None = None


@dataclass(frozen=True)
class ReadEnd:
    """Where a storage -> L2 read's slots go once its Completion arrived."""

    landed: list[int]  # leading slots read and verified: the owner adopts them
    empty: list[int]  # slots the read did not fill and nobody touches: free now
    quarantined: list[int]  # the service may still write them: untouched until Settled
    settled: bool = True  # False: every slot is quarantined, until the ticket's Settled
    late: bool = False  # unsettled though nobody gave it up (a timeout)


@dataclass(frozen=True)
class StoreEnd:
    """How an L2 -> storage store ended."""

    stored: bool  # every page persisted
    quarantined: bool  # unsettled: its slots stay held and unchanged until Settled


class SlotTickets(Generic[J, H]):
    """Storage tickets in flight with their owner's jobs, and the unsettled ones' slots."""

    def __init__(self) -> None:
        self.open: dict[int, J] = {}  # ticket -> job, until its Completion
        self.unsettled: dict[int, Unsettled[H]] = {}  # ticket -> slots, until its Settled
        self._given_up: set[int] = set()  # open tickets whose requester stopped waiting

    def __len__(self) -> int:
        return len(self.open)

    def add(self, ticket: int, job: J) -> None:
        if ticket in self.open or ticket in self.unsettled:
            raise ValueError(f"storage ticket {ticket} is booked already")
        self.open[ticket] = job

    def get(self, ticket: int) -> J | None:
        return self.open.get(ticket)

    def give_up(self, ticket: int) -> bool:
        """The requester waits no more for `ticket`; whether it is still open (then the
        caller cancels it: its Completion and Settled still come, and are handled here)."""
        if ticket not in self.open:
            return False
        self._given_up.add(ticket)
        return True

    def take(self, ticket: int) -> J | None:
        """The job of a ticket whose Completion arrived (None: not ours, or not open)."""
        job = self.open.pop(ticket, None)
        if job is None:
            self._given_up.discard(ticket)
        return job

    def read_done(self, c: Completion, slots: Sequence[int], hold: H | None = None) -> ReadEnd:
        """A load ticket's Completion over its `slots` (in page order)."""
        given_up = c.ticket in self._given_up
        self._given_up.discard(c.ticket)
        owned = list(slots)
        if not c.settled:
            self.unsettled[c.ticket] = Unsettled(TicketKind.LOAD, owned, hold)
            return ReadEnd([], [], list(owned), settled=False, late=not given_up)
        k = max(0, min(c.pages_ok, len(owned)))
        return ReadEnd(owned[:k], owned[k:], [])

    def store_done(self, c: Completion, slots: Sequence[int], hold: H | None = None) -> StoreEnd:
        """A store ticket's Completion over its `slots`."""
        self._given_up.discard(c.ticket)
        if not c.settled:
            self.unsettled[c.ticket] = Unsettled(TicketKind.STORE, list(slots), hold)
            return StoreEnd(stored=False, quarantined=True)
        return StoreEnd(c.error is None and c.pages_ok >= len(slots), quarantined=False)

    def settle(self, s: Settled) -> Unsettled[H] | None:
        """The service touches the slots of `s.ticket` no more: they are the owner's again
        (load slots to free, store slots to release). None: nothing was quarantined."""
        return self.unsettled.pop(s.ticket, None)

    def quarantined(self, kind: TicketKind | None = None) -> list[int]:
        """Slots of unsettled tickets (of `kind`, or all)."""
        return [s for u in self.unsettled.values() if kind in (None, u.kind) for s in u.slots]
