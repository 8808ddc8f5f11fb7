"""Page traffic of the remote tier on plain RESP connections (see `storage.remote.backend`).

A batch of GETs or SETs is pipelined on one pooled connection of the node that
owns their keys. A GET reply is received into the call's private buffer within
the page's time limit (`page_timeout_s`, and the job's deadline) and verified;
a job whose deadline passes mid-batch leaves the rest of the replies unread and
its connection is dropped (LATE, no outage). A reused connection that breaks
before any reply is retried once on a fresh one; any other transport error is
an outage (the link's breaker trips).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from asynchicache.common.deadline import Deadline, passed
from asynchicache.storage.base import PageRef
from asynchicache.storage.page_keys import MacMismatch
from asynchicache.storage.remote.link import OUTAGE, RemoteLink
from asynchicache.storage.remote.resp import NodeAddress, RespConnection, RespError, command
from asynchicache.storage.remote.value import MacRejected, ValueFormat, ValueRejected

log = logging.getLogger(__name__)


class PageStatus(StrEnum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    LATE = "late"
    FAILED = "failed"  # transport error or an error reply: not the value's fault


@dataclass(frozen=True)
class PageRead:
    index: int
    status: PageStatus
    tokens: tuple[int, ...] = ()
    reason: str = ""
    parent: bytes = b""


@dataclass(frozen=True)
class PageCall:
    """What the pages of one get/put share."""

    hashes: list[bytes]
    keys: list[bytes]
    slots: list[int]
    pool: np.ndarray  # [rows, page_bytes] uint8: where pages are read into / sent from
    deadline: Deadline | None  # no page starts after it passed

    def late(self) -> bool:
        return passed(self.deadline)


class JobLate(Exception):
    """The job's deadline passed in the middle of a pipelined batch."""


class PagePipeline:
    """Pipelined GETs and SETs of pages on one node's pooled connection, each page
    within its time limit; what a connection did not finish is FAILED or LATE."""

    def __init__(
        self,
        link: RemoteLink,
        value_format: ValueFormat,
        page_timeout_s: float,
        count: Callable[..., None],
    ) -> None:
        self._link = link
        self._format = value_format
        self._page_timeout_s = page_timeout_s
        self._count = count

    def read_batch(self, call: PageCall, node: NodeAddress, idx: list[int]) -> list[PageRead]:
        """GET pages `idx` (all on `node`) pipelined on one connection, into `call.pool`."""
        if call.late():
            self._count(late_skipped=len(idx))
            return [PageRead(i, PageStatus.LATE) for i in idx]
        request = b"".join(command(b"GET", call.keys[i]) for i in idx)

        def work(conn: RespConnection, done: list[PageRead]) -> None:
            conn.send([request])
            for i in idx:
                if call.late():  # the rest of the replies stay unread: the connection goes
                    raise JobLate
                done.append(self._read_page(conn, i, call))

        return self._on_connection(node, idx, work, call.deadline)

    def _on_connection(
        self,
        node: NodeAddress,
        idx: list[int],
        work: Callable[[RespConnection, list[PageRead]], None],
        deadline: Deadline | None = None,
    ) -> list[PageRead]:
        """Run `work(conn, done)` on a pooled connection; pages it did not finish are FAILED
        (LATE when the job's deadline stopped them: that is no outage).

        A reused connection that breaks before any reply (the server or a proxy closed it
        while it sat idle) is retried once on a new one; anything else trips the breaker.
        """
        done: list[PageRead] = []
        rest = PageStatus.FAILED
        for fresh in (False, True):
            reused = False
            try:
                topo = self._link.topology
                if topo is None:
                    raise ConnectionError("remote tier not connected")
                with topo.connection(node, fresh) as conn:
                    reused = conn.uses > 1
                    work(conn, done)
                break
            except JobLate:
                rest = PageStatus.LATE
                break
            except OUTAGE as exc:
                if passed(deadline):  # our own time limit, not the server's fault
                    rest = PageStatus.LATE
                    break
                if reused and not done and not isinstance(exc, TimeoutError):
                    self._count(stale_retries=1)
                    continue
                self._link.outage(exc)
                break
        if rest is PageStatus.LATE:
            self._count(late_aborted=len(idx) - len(done))
        return done + [PageRead(i, rest) for i in idx[len(done) :]]

    def _read_page(self, conn: RespConnection, i: int, call: PageCall) -> PageRead:
        """One GET reply, within the page's time limit: header checked, payload into its
        row of `call.pool`, then its checksum."""
        dst = memoryview(call.pool[call.slots[i]])
        limit = time.monotonic() + self._page_timeout_s
        left = call.deadline.left_s() if call.deadline is not None else None
        # A hair past the deadline, so that a limit reached there always reads as "late".
        until = limit if left is None else min(limit, time.monotonic() + left + 0.001)
        conn.set_time_limit(until)
        try:
            header = self._format.read_page(conn, call.hashes[i], dst)
        except RespError as exc:
            return self._error_reply(i, exc)
        except ValueRejected as exc:
            why = MacMismatch(exc) if isinstance(exc, MacRejected) else str(exc)
            return PageRead(i, PageStatus.CORRUPT, reason=why)
        finally:
            conn.set_time_limit(None)
        if header is None:
            return PageRead(i, PageStatus.MISSING)
        return PageRead(i, PageStatus.OK, header.tokens, parent=header.parent)

    def _error_reply(self, i: int, exc: RespError) -> PageRead:
        if exc.kind in ("MOVED", "ASK"):
            self._count(moved=1)
            self._link.refresh_topology()
        else:
            self._count(server_errors=1)
            log.debug("redis GET error reply: %s", exc)
        # WRONGTYPE: something that is not our value sits under our key; replace it.
        status = PageStatus.CORRUPT if exc.kind == "WRONGTYPE" else PageStatus.FAILED
        return PageRead(i, status, reason=str(exc))

    def write_batch(
        self, call: PageCall, node: NodeAddress, idx: list[int], pages: list[PageRef]
    ) -> list[PageRead]:
        """SET pages `idx` pipelined on one connection, each sent straight from its slot."""
        if call.late():
            return [PageRead(i, PageStatus.LATE) for i in idx]
        buffers: list[bytes | memoryview] = []
        for n, i in enumerate(idx):  # n: the page's scratch buffer, when encrypted
            payload = memoryview(call.pool[call.slots[i]])
            page = pages[i]
            buffers += self._format.set_command(
                call.keys[i], call.hashes[i], page.tokens, payload, page.parent, n
            )

        def work(conn: RespConnection, done: list[PageRead]) -> None:
            conn.send(buffers)  # SET is idempotent: a retry on a new connection is safe
            for i in idx:
                try:
                    conn.read_status()
                    done.append(PageRead(i, PageStatus.OK))
                except RespError as exc:  # e.g. OOM: maxmemory reached, noeviction
                    self._count(server_errors=1)
                    done.append(PageRead(i, PageStatus.FAILED, reason=str(exc)))

        results = self._on_connection(node, idx, work)
        failed = [r for r in results if r.reason]
        if failed:
            log.warning("remote: %d pages not stored: %s", len(failed), failed[0].reason)
        return results
