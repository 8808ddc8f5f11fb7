"""`FinishedTickets`: hands each finished copy or storage ticket to the job's owner.

Every ticket in flight maps to one job (jobs.py): a `WriteJob` or `StoreJob`
is the `Writer`'s, a `LoadJob` `PageLoads`'. A handler that raises must not
stop the others nor leak its job: the job ends (a load with an error), and the
failure is counted and logged. A `Settled` (the service touches a timed-out
ticket's slots no more) releases that ticket's quarantine. Storage tickets are
booked in `SlotTickets` (slot_tickets.py), the lifecycle the vLLM connector shares.
"""

from __future__ import annotations

import logging

from asynchicache.hierarchy.l2.jobs import LoadJob, StoreJob, WriteJob
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.hierarchy.l2.loads import PageLoads
from asynchicache.hierarchy.l2.transfer import TransferDone
from asynchicache.hierarchy.l2.writes import Writer
from asynchicache.hierarchy.parts import CacheParts
from asynchicache.storage.base import Completion, Settled, TicketKind

log = logging.getLogger(__name__)


class FinishedTickets:
    """Polls the transfer engine and the storage tier, and routes what finished."""

    def __init__(self, parts: CacheParts, writer: Writer, loads: PageLoads) -> None:
        self.parts = parts
        self.writer = writer
        self.loads = loads

    def poll(self) -> None:
        """Complete every finished copy and storage operation; never blocks."""
        parts = self.parts
        for done in parts.transfer.poll():
            self._complete(parts.transfers.pop(done.ticket, None), done)
        if parts.storage is None:
            return
        try:
            results = parts.storage.poll()
        except Exception:
            log.exception("storage.poll failed")
            return
        for r in results:
            if isinstance(r, Settled):
                self._settle(r)
            else:
                self._complete(parts.tickets.take(r.ticket), r)

    def _complete(
        self, job: WriteJob | StoreJob | LoadJob | None, result: TransferDone | Completion
    ) -> None:
        if job is None:
            log.warning("completion for an unknown ticket: %s", result)
            return
        try:
            if isinstance(job, LoadJob):
                if isinstance(result, Completion):
                    self.loads.on_read(job, result)
                else:
                    self.loads.on_fill(job, result)
            elif isinstance(job, WriteJob):
                self.writer.on_write(job, result)  # type: ignore[arg-type]
            else:
                self.writer.on_store(job, result)  # type: ignore[arg-type]
        except Exception as exc:
            log.exception("cache completion handler failed for %s", result)
            self.parts.counters.completion_failures += 1
            self._fail(job, f"completion failed: {type(exc).__name__}: {exc}")

    def _fail(self, job: WriteJob | StoreJob | LoadJob, error: str) -> None:
        try:
            if isinstance(job, LoadJob):
                self.loads.fail(job, error)
            else:
                self.writer.fail(job)
        except Exception:
            log.exception("cleaning up after a failed completion failed too")

    def _settle(self, settled: Settled) -> None:
        record = self.parts.tickets.settle(settled)
        if record is None:
            log.warning("settled for a ticket with nothing quarantined: %s", settled)
            return
        self.parts.counters.settled_tickets += 1
        if record.kind == TicketKind.LOAD:
            self.parts.host.move(record.slots, SlotState.LOAD_QUARANTINED, SlotState.FREE)
        else:
            self.writer.settle_store(record)
