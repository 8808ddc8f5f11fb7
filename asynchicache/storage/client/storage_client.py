"""The engine's side of the cache service: `StorageClient`, a non-blocking `StorageTier`.

`submit_load`/`submit_store` send a request and return its ticket at once;
`poll()` drains replies without blocking and returns `Completion`s and
`Settled`s. Nothing the scheduler calls waits on I/O, except `exists()`, a
request/reply bounded by a short timeout (0 pages when the service does not
answer in time).

Failure handling, so the engine can always fall back to recompute without a
late storage job ever touching a slot it reused (`storage.client.tickets` holds the
ticket lifetimes):

* every ticket has an absolute CLOCK_MONOTONIC deadline, set at submit. The
  request carries it (less a 10% margin, so that a slow but working service
  answers before the client gives up) and the service checks it before every
  page it reads, writes or copies: time queued in a socket or a frozen
  service is not free. Past the deadline the ticket completes with
  `settled=False` and a `Cancel` goes out: its slots stay quarantined until a
  `Settled` for it, on the service's late final reply, a cancel the service
  acknowledges as settled (the job never started, or had not arrived and is
  now refused), or the service process's exit;
* `cancel(ticket)` gives a ticket up the same way at once (the engine's
  abandoned loads);
* the DEALER socket watches its connection (a ZeroMQ monitor): when the
  service goes away every open ticket completes at the next `poll()` —
  settled if the service process is gone (its pid, pinned by its start time,
  comes with `RegisterReply`; a zombie counts as gone), else unsettled until
  it is gone or answers a `Cancel` after a reconnect. New tickets fail at once
  while it is away (`ZMQ_IMMEDIATE`: nothing is queued for a service that is
  not there), and so do tickets refused before reaching it: those are settled;
* ZeroMQ reconnects when a service comes back at the same address; the client
  re-registers on every new connection, on a heartbeat, and when the service
  answers "unregistered" (then it also resends that request once).

Administration of the namespace (bounded waits, for the engine's admin path,
never the scheduler's): `clear()` per tier and scope, `pin()` / `unpin()` /
`pins()`, `contents()`; and, with `ClientConfig.events`, the namespace's L3/L4
KV events, drained by `poll()` and handed out by `take_events()` (gaps
flagged: storage.client.event_feed).

`quarantined` counts the tickets given up but not settled; `counters` how
often each signal settled one. `storage.service.in_thread.client_in_thread(...)`
runs the service in a thread of this process, behind the same interface, for tests
and small deployments: the client's `close()` stops it and settles every quarantined
ticket.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from asynchicache.common.liveness import ProcessIdentity
from asynchicache.common.sockets import queued
from asynchicache.storage.admin_messages import Pins, PinsReply, StorageEvents
from asynchicache.storage.base import (
    Completion,
    PageLayout,
    PageRef,
    Settled,
    TicketKind,
    TierStats,
)
from asynchicache.storage.client.admin_client import AdminRequests
from asynchicache.storage.client.client_config import ClientConfig
from asynchicache.storage.client.event_feed import EventBatch, EventFeed
from asynchicache.storage.client.snapshots import Snapshots
from asynchicache.storage.client.tickets import OpenTicket, TicketBook
from asynchicache.storage.messages import (
    Cancel,
    CancelReply,
    ErrorReply,
    Exists,
    ExistsReply,
    Load,
    LoadReply,
    PagesReply,
    Register,
    RegisterReply,
    Reply,
    Request,
    Stats,
    StatsReply,
    Store,
    decode,
    encode,
)

log = logging.getLogger(__name__)

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED
# The service's work deadline comes this share of the timeout before the client gives
# up: a service that is slow but working answers (settled) before the ticket times out.
_SERVICE_MARGIN = 0.1
_EXIT_CHECK_S = 0.05  # how often orphaned tickets look whether their service exited


class StorageClient(AdminRequests):
    """`StorageTier` over ZeroMQ; not thread-safe (one scheduler thread calls it).

    The namespace's administration (clear, pins, contents) comes from
    `AdminRequests` (storage.client.admin)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._ids = itertools.count(1)
        self._book = TicketBook()
        self._service_id: ProcessIdentity | None = None  # the service that registered us
        self._last_exit_check = 0.0
        self._closed = False
        self._answers: dict[int, Reply] = {}
        self._events = EventFeed()
        self._snapshots = Snapshots()  # stats and pins for the engine's thread
        self._up = False
        self._registered = False
        self._slots = 0
        self._last_register = 0.0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, b"c" + os.urandom(15))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, config.reconnect_ms)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._monitor = self._sock.get_monitor_socket(_UP | _DOWN)
        if config.curve is not None:
            config.curve.apply(self._sock)
        self._sock.connect(config.address)
        self._service: tuple[threading.Event, threading.Thread] | None = None

    @classmethod
    def connect(cls, address: str, timeout_s: float = 10.0) -> StorageClient:
        """A client for the service at `address` whose L2 pool is registered later.

        Returns at once (ZeroMQ connects in the background). Until
        `register_pool` is called, tickets fail at once and `exists()` is 0.
        `timeout_s` is the per-ticket timeout.
        """
        return cls(ClientConfig(address, ticket_timeout_s=timeout_s))

    def register_pool(self, namespace: bytes, segment: str, layout: PageLayout) -> None:
        """Tell the service which L2 pool our slots index (the engine calls this once its
        HostPool exists: `Namespace.encode()`, `HostPool.segment.name`, one page's layout)."""
        self.config = dataclasses.replace(
            self.config, namespace=namespace, segment=segment, layout=layout
        )
        self._registered = False
        self._pump_monitor()
        if self._up:
            self._register()

    def own_service(self, stop: threading.Event, thread: threading.Thread) -> None:
        """Stop `thread`, a cache service of this process, at `close()`: set `stop`, join,
        then settle every quarantined ticket (storage.service.in_thread)."""
        self._service = (stop, thread)

    # -- StorageTier ------------------------------------------------------

    def exists(self, hashes: Sequence[bytes]) -> int:
        return sum(self.exists_by_tier(hashes))

    def exists_by_tier(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(leading pages on disk, the pages after those only in the remote tier); (0, 0)
        when the service does not answer in time."""
        if not hashes or not self.config.has_pool:
            return 0, 0
        reply = self._ask(Exists(next(self._ids), tuple(hashes)), self.config.exists_timeout_s)
        if not isinstance(reply, ExistsReply):
            return 0, 0
        remote = max(0, min(reply.remote_pages, reply.pages))
        return reply.pages - remote, remote

    def submit_load(self, hashes: Sequence[bytes], slots: Sequence[int]) -> int:
        ticket = next(self._ids)
        deadline_ns = self._service_deadline_ns()
        request = Load(ticket, tuple(hashes), tuple(slots), deadline_ns)
        self._start(ticket, TicketKind.LOAD, len(hashes), request)
        return ticket

    def submit_store(self, pages: Sequence[PageRef]) -> int:
        ticket = next(self._ids)
        request = Store(ticket, tuple(pages), self._service_deadline_ns())
        self._start(ticket, TicketKind.STORE, len(pages), request)
        return ticket

    def cancel(self, ticket: int) -> None:
        """Give `ticket` up now: its `Completion` (error "cancelled", `settled=False`) comes
        at the next `poll()`, its `Settled` once the service stopped or skipped the job.
        Nothing happens for a ticket already completed."""
        if self._book.give_up(ticket, "cancelled"):
            self._book.counters["cancelled"] += 1
            if self._up:
                self._send(Cancel(next(self._ids), ticket))

    def poll(self) -> list[Completion | Settled]:
        self._pump()
        done, self._book.events = self._book.events, []
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._service is not None:
            stop, thread = self._service
            stop.set()
            thread.join(timeout=30)
            if not thread.is_alive():  # its workers finished: no slot is touched any more
                self._book.settle_all("client closed")

    # -- extras -------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the service is reachable and has accepted our pool (if we have one yet)."""
        return self._up and (self._registered or not self.config.has_pool)

    @property
    def pending(self) -> int:
        """Tickets submitted and not completed yet."""
        return len(self._book.open)

    @property
    def quarantined(self) -> int:
        """Tickets given up (timed out, cancelled, disconnected) and not settled yet: their
        slots may still be touched by the service."""
        return len(self._book.quarantined)

    @property
    def counters(self) -> dict[str, int]:
        """Tickets quarantined and cancelled, and how each settled (late reply, cancel
        acknowledged, refused, service exited, client closed)."""
        return dict(self._book.counters)

    def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """Block until connected and registered (start-up helper; not for the scheduler path)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._pump_monitor()
            self._pump_replies()
            if not self.connected and self._up and time.monotonic() - self._last_register > 0.2:
                self._register()
            # A round trip proves the connection is live (a loss may not be reported yet).
            if self.connected and self._ask(Stats(next(self._ids)), 0.5) is not None:
                return self.connected
            self._sock.poll(10)
        return False

    def wait(self, tickets: Iterable[int], timeout_s: float) -> list[Completion]:
        """Poll until all `tickets` completed or `timeout_s` passed (tests, tools, shutdown);
        other events stay queued for the caller's next `poll()`."""
        return self._wait(Completion, tickets, timeout_s)

    def wait_settled(self, tickets: Iterable[int], timeout_s: float) -> list[Settled]:
        """Poll until all `tickets` (completed unsettled) settled, or `timeout_s` passed."""
        return self._wait(Settled, tickets, timeout_s)

    def _wait(self, kind: type, tickets: Iterable[int], timeout_s: float) -> list[Any]:
        want = set(tickets)
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while True:
            self._pump()
            got += self._book.take(kind, want)  # other events stay for the next poll()
            if not want or self._closed or time.monotonic() > deadline:
                return got
            self._sock.poll(5)

    def stats(self, timeout_s: float = 1.0) -> TierStats | None:
        reply = self._ask(Stats(next(self._ids)), timeout_s)
        if not isinstance(reply, StatsReply):
            return None
        return TierStats(reply.disk, reply.service, reply.remote, time.monotonic())

    def stats_snapshot(self, max_age_s: float = 1.0) -> TierStats | None:
        got = self._snapshot("stats", Stats, max_age_s)
        reply = got[0] if got is not None else None
        if got is None or not isinstance(reply, StatsReply):
            return None
        return TierStats(reply.disk, reply.service, reply.remote, got[1])

    def pins_snapshot(self, max_age_s: float = 1.0) -> tuple[PinsReply, float] | None:
        """The service's latest pins listing and its arrival (CLOCK_MONOTONIC), never
        waiting (as `stats_snapshot`)."""
        got = self._snapshot("pins", Pins, max_age_s)
        if got is None or not isinstance(got[0], PinsReply):
            return None
        return got[0], got[1]

    def _snapshot(
        self, kind: str, make: Callable[[int], Request], max_age_s: float
    ) -> tuple[object, float] | None:
        self._pump_monitor()
        self._pump_replies()
        if self._up and self._snapshots.want(kind, max_age_s):
            msg = make(next(self._ids))
            if self._send(msg):
                self._snapshots.asked(kind, msg.req_id)
        return self._snapshots.latest(kind)

    def take_events(self) -> EventBatch:
        """KV events received (by `poll()` and the waits) since the last call, in order."""
        self._pump_replies()
        return self._events.take()

    @property
    def events_lost(self) -> int:
        return self._events.lost

    def _request(self, make: Callable[[int], object], timeout_s: float) -> Reply | None:
        msg = make(next(self._ids))
        if not isinstance(msg, Request):
            raise TypeError(f"not a storage request: {type(msg).__name__}")
        return self._ask(msg, timeout_s)

    # -- internals ----------------------------------------------------------

    def _pump(self) -> None:
        """Take what the socket and the clock say; events queue up in the book."""
        if self._closed:
            return
        now = time.monotonic()
        self._pump_monitor()
        self._pump_replies()
        self._expire(now)
        if self._book.has_orphans and now - self._last_exit_check > _EXIT_CHECK_S:
            self._last_exit_check = now
            self._book.settle_exited()
        if self._up and now - self._last_register > self.config.heartbeat_s:
            self._register()

    def _service_deadline_ns(self) -> int:
        """The request's deadline: CLOCK_MONOTONIC, shared with the service's process."""
        share = 1.0 - _SERVICE_MARGIN
        return time.monotonic_ns() + int(self.config.ticket_timeout_s * share * 1e9)

    def _start(self, ticket: int, kind: TicketKind, n: int, request: Request) -> None:
        self._pump_monitor()
        give_up_at = time.monotonic() + self.config.ticket_timeout_s
        service = self._service_id if self._registered else None
        self._book.add(ticket, OpenTicket(kind, n, give_up_at, request, service))
        # Refused before reaching the service: settled at once.
        if not self.config.has_pool:
            self._book.refuse(ticket, "no L2 pool registered with the storage client")
        elif not self._up:
            self._book.refuse(ticket, "cache service unavailable")
        elif not self._send(request):
            self._book.refuse(ticket, "cache service not accepting requests")

    def _send(self, msg: Request) -> bool:
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _register(self) -> None:
        self._last_register = time.monotonic()
        cfg = self.config
        if cfg.layout is not None and cfg.has_pool:
            msg = Register(next(self._ids), cfg.namespace, cfg.segment, cfg.layout, cfg.events)
            self._send(msg)

    def _ask(self, msg: Request, timeout_s: float) -> Reply | None:
        """Send a request and wait up to `timeout_s` for its own reply; others are kept."""
        self._pump_monitor()
        if not self._up or not self._send(msg):
            return None
        deadline = time.monotonic() + timeout_s
        while msg.req_id not in self._answers:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._up:
                return None
            self._sock.poll(left_ms)
            self._pump_monitor()
            self._pump_replies()
        return self._answers.pop(msg.req_id)

    def _pump_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == _UP:
                log.info("cache service connected at %s", self.config.address)
                self._up = True
                self._registered = False
                self._register()
            elif event == _DOWN and self._up:
                log.warning("cache service at %s went away", self.config.address)
                self._up = False
                self._registered = False
                self._answers.clear()
                self._book.disconnected()

    def _pump_replies(self) -> None:
        for payload in queued(self._sock.recv):
            try:
                self._on_reply(decode(payload))
            except ValueError as exc:
                log.warning("storage client: bad reply dropped: %s", exc)

    def _on_reply(self, reply: Reply) -> None:
        if isinstance(reply, StorageEvents):
            self._events.received(reply)
        elif isinstance(reply, RegisterReply):
            self._on_registered(reply)
        elif isinstance(reply, PagesReply):
            remote = reply.pages_from_remote if isinstance(reply, LoadReply) else 0
            self._book.answered(reply.req_id, reply.pages_ok, reply.error, remote)
        elif isinstance(reply, CancelReply):
            if reply.settled:
                self._book.settle(reply.target, "cancel acknowledged")
        elif isinstance(reply, ErrorReply) and reply.req_id in self._book.open:
            self._retry_or_fail(reply)
        elif isinstance(reply, ErrorReply) and reply.req_id in self._book.quarantined:
            self._book.settle(reply.req_id, "refused")  # the service did not take it
        elif self._snapshots.take(reply.req_id, reply):
            pass
        else:
            self._answers[reply.req_id] = reply
            if len(self._answers) > 1024:  # answers nobody waits for any more (timed out)
                self._answers.pop(next(iter(self._answers)))

    def _on_registered(self, reply: RegisterReply) -> None:
        self._registered = reply.error is None
        self._slots = reply.slots
        if self._registered and self.config.events:
            self._events.subscribed(reply.pid, reply.events_seq)
        if reply.error:
            log.warning("cache service refused registration: %s", reply.error)
        if reply.pid <= 0:
            return
        service = self._service_id
        if service is None or service.pid != reply.pid or not service.alive():
            service = ProcessIdentity.of(reply.pid)
        self._service_id = service
        self._book.identify(service)
        # Back on the same service after a dropped connection: ask it about what we gave up.
        for ticket in self._book.orphans_of(service):
            self._send(Cancel(next(self._ids), ticket))

    def _retry_or_fail(self, reply: ErrorReply) -> None:
        pending = self._book.open[reply.req_id]
        if reply.code == "unregistered" and not pending.resent:
            pending.resent = True
            self._register()
            if self._send(pending.request):
                return
        self._book.refuse(reply.req_id, f"{reply.code}: {reply.message}")

    def _expire(self, now: float) -> None:
        for ticket in self._book.overdue(now):
            self._book.give_up(ticket, "timed out")
            self._book.counters["timed_out"] += 1
            if self._up:
                self._send(Cancel(next(self._ids), ticket))
