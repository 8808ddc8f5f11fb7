"""The lifetime of a storage ticket on the client side, written once.

    open --final reply, or refused before reaching the service--> done: Completion(settled)
    open --deadline, cancel(), connection dropped--> quarantined: Completion(settled=False)
    quarantined --late final reply, cancel acknowledged as settled, refused by the
                  service, or the service process gone--> done: Settled

A ticket yields exactly one `Completion` and, when that one is unsettled,
exactly one `Settled` later. While a ticket is quarantined the service may
still read into or write from its L2 slots, so the engine must not reuse them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from asynchicache.common.liveness import ProcessIdentity
from asynchicache.storage.base import Completion, Settled, TicketKind


@dataclass
class OpenTicket:
    kind: TicketKind
    requested: int
    give_up_at: float  # monotonic seconds: the client reports a timeout then
    request: Any  # the Load/Store sent (resent once after an "unregistered" answer)
    service: ProcessIdentity | None  # the service it went to; None until it registers us
    resent: bool = False


@dataclass
class _Quarantined:
    service: ProcessIdentity | None
    orphaned: bool = False  # its connection dropped: the service's exit settles it


class TicketBook:
    """Open and quarantined tickets, and the events `poll()` hands out; not thread-safe."""

    def __init__(self) -> None:
        self.open: dict[int, OpenTicket] = {}
        self.quarantined: dict[int, _Quarantined] = {}
        self.events: list[Completion | Settled] = []
        self.counters: Counter[str] = Counter()

    def add(self, ticket: int, t: OpenTicket) -> None:
        self.open[ticket] = t

    def refuse(self, ticket: int, error: str) -> None:
        """An open ticket the service never got or never started: done, settled."""
        self.answered(ticket, 0, error)

    def answered(self, ticket: int, pages_ok: int, error: str | None, remote: int = 0) -> None:
        """The service's final reply (or a refusal): completes or settles the ticket."""
        t = self.open.pop(ticket, None)
        if t is not None:
            self.events.append(
                Completion(ticket, t.kind, pages_ok, t.requested, error, remote, settled=True)
            )
        else:
            self.settle(ticket, "late reply")

    def give_up(self, ticket: int, error: str, settled: bool = False) -> bool:
        """Complete an open ticket without waiting for the service; False if not open."""
        t = self.open.pop(ticket, None)
        if t is None:
            return False
        if not settled:
            self.quarantined[ticket] = _Quarantined(t.service)
            self.counters["quarantined"] += 1
        self.events.append(Completion(ticket, t.kind, 0, t.requested, error, 0, settled=settled))
        return True

    def settle(self, ticket: int, reason: str) -> None:
        if self.quarantined.pop(ticket, None) is not None:
            self.events.append(Settled(ticket, reason))
            self.counters[f"settled_{reason.replace(' ', '_')}"] += 1

    def take(self, kind: type, tickets: set[int]) -> list[Any]:
        """Remove and return the queued events of type `kind` for `tickets` (which loses
        them); the other events stay queued in order."""
        taken = [e for e in self.events if isinstance(e, kind) and e.ticket in tickets]
        if taken:
            gone = {id(e) for e in taken}
            self.events = [e for e in self.events if id(e) not in gone]
            tickets.difference_update(e.ticket for e in taken)
        return taken

    def overdue(self, now: float) -> list[int]:
        return [t for t, o in self.open.items() if o.give_up_at < now]

    def identify(self, service: ProcessIdentity) -> None:
        """The service answered our registration: tickets sent before we knew it went there."""
        for t in self.open.values():
            if t.service is None:
                t.service = service
        for q in self.quarantined.values():
            if q.service is None and not q.orphaned:
                q.service = service

    def disconnected(self) -> None:
        """The connection dropped: open tickets are given up (settled only if their service
        is known to be gone), every quarantined one waits for its service's exit."""
        for ticket, t in list(self.open.items()):
            gone = t.service is not None and not t.service.alive()
            self.give_up(ticket, "cache service disconnected", settled=gone)
        for q in self.quarantined.values():
            q.orphaned = True

    def orphans_of(self, service: ProcessIdentity) -> list[int]:
        """Orphaned tickets that went to `service` (reconnected: it may answer a Cancel),
        or to a service never identified (the best guess: the one that answers now)."""
        return [
            t for t, q in self.quarantined.items() if q.orphaned and q.service in (service, None)
        ]

    def settle_exited(self) -> None:
        """Settle orphaned tickets whose service process is gone."""
        alive: dict[ProcessIdentity, bool] = {}
        for ticket, q in list(self.quarantined.items()):
            if not q.orphaned or q.service is None:
                continue
            if q.service not in alive:
                alive[q.service] = q.service.alive()
            if not alive[q.service]:
                self.settle(ticket, "service exited")

    def settle_all(self, reason: str) -> None:
        for ticket in list(self.quarantined):
            self.settle(ticket, reason)

    @property
    def has_orphans(self) -> bool:
        return any(q.orphaned for q in self.quarantined.values())
