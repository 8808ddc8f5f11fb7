"""The engine's side of the cache service: `StorageClient`, a non-blocking `StorageTier`.

`submit_load`/`submit_store` send a request and return its ticket at once;
`poll()` drains replies without blocking and returns `Completion`s. Nothing
the scheduler calls waits on I/O, except `exists()`, a request/reply bounded
by a short timeout (0 pages when the service does not answer in time).

Failure handling, so the engine can always fall back to recompute:

* every ticket has a deadline; past it, it completes with an error. The
  service starts no page read or write after 80% of that deadline, so a
  timed-out load's slots are normally quiet when the engine reuses them; a
  read already inside the kernel when a service is frozen (SIGSTOP, a hung
  disk) for longer than the margin can still land later (known gap);
* the DEALER socket watches its connection (a ZeroMQ monitor): when the
  service goes away, every pending ticket fails at the next `poll()`, and new
  tickets fail at once while it is away (`ZMQ_IMMEDIATE`: nothing is queued
  for a service that is not there);
* ZeroMQ reconnects when a service comes back at the same address; the client
  re-registers on every new connection, on a heartbeat, and when the service
  answers "unregistered" (then it also resends that request once).

`StorageClient.in_thread(...)` runs the service in a thread of this process,
behind the same interface, for tests and small deployments.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from asynchicache.storage.base import Completion, PageLayout, PageRef, TicketKind
from asynchicache.storage.messages import (
    Cancel,
    Clear,
    ClearReply,
    ErrorReply,
    Exists,
    ExistsReply,
    Load,
    LoadReply,
    Register,
    RegisterReply,
    Reply,
    Request,
    Stats,
    StatsReply,
    Store,
    StoreReply,
    decode,
    encode,
)
from asynchicache.storage.service import CacheService, ServiceConfig

log = logging.getLogger(__name__)

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class ClientConfig:
    """How an engine reaches the cache service and what it registers there."""

    address: str
    namespace: bytes = b""  # Namespace.encode() of the model's pages
    segment: str = ""  # name of the L2 pool's shared-memory segment
    layout: PageLayout | None = None  # one page of that pool
    ticket_timeout_s: float = 10.0
    exists_timeout_s: float = 0.05
    heartbeat_s: float = 1.0
    reconnect_ms: int = 100

    def __post_init__(self) -> None:
        if self.ticket_timeout_s <= 0 or self.exists_timeout_s <= 0:
            raise ValueError("storage client timeouts must be positive")

    @property
    def has_pool(self) -> bool:
        return bool(self.namespace and self.segment and self.layout is not None)


@dataclass
class _Pending:
    kind: TicketKind
    requested: int
    deadline: float
    request: Request
    resent: bool = False


class StorageClient:
    """`StorageTier` over ZeroMQ; not thread-safe (one scheduler thread calls it)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._done: list[Completion] = []
        self._answers: dict[int, Reply] = {}
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

    @classmethod
    def in_thread(cls, service: ServiceConfig, client: ClientConfig) -> StorageClient:
        """A client with its own service running in a thread (stopped by `close()`)."""
        stop = threading.Event()
        svc = CacheService(service, stop)  # binds before the client connects
        thread = threading.Thread(target=svc.run, name="cache-service", daemon=True)
        thread.start()
        made = cls(dataclasses.replace(client, address=service.address))
        made._service = (stop, thread)
        return made

    # -- StorageTier ------------------------------------------------------

    def exists(self, hashes: Sequence[bytes]) -> int:
        if not hashes or not self.config.has_pool:
            return 0
        reply = self._ask(Exists(next(self._ids), tuple(hashes)), self.config.exists_timeout_s)
        return reply.pages if isinstance(reply, ExistsReply) else 0

    def submit_load(self, hashes: Sequence[bytes], slots: Sequence[int]) -> int:
        ticket = next(self._ids)
        # The service starts no page read after 80% of our deadline, so when we
        # report a timeout, reads into these slots have normally ended too.
        timeout_ms = int(self.config.ticket_timeout_s * 800)
        request = Load(ticket, tuple(hashes), tuple(slots), timeout_ms)
        self._start(ticket, TicketKind.LOAD, len(hashes), request)
        return ticket

    def submit_store(self, pages: Sequence[PageRef]) -> int:
        ticket = next(self._ids)
        timeout_ms = int(self.config.ticket_timeout_s * 800)
        self._start(ticket, TicketKind.STORE, len(pages), Store(ticket, tuple(pages), timeout_ms))
        return ticket

    def cancel(self, ticket: int) -> None:
        """Ask the service to skip the ticket if not started; it still completes via poll()."""
        if ticket in self._pending and self._up:
            self._send(Cancel(next(self._ids), ticket))

    def poll(self) -> list[Completion]:
        now = time.monotonic()
        self._pump_monitor()
        self._pump_replies()
        self._expire(now)
        if self._up and now - self._last_register > self.config.heartbeat_s:
            self._register()
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._service is not None:
            stop, thread = self._service
            stop.set()
            thread.join(timeout=30)

    # -- extras -------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the service is reachable and has accepted our pool (if we have one yet)."""
        return self._up and (self._registered or not self.config.has_pool)

    @property
    def pending(self) -> int:
        return len(self._pending)

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
        """Poll until all `tickets` completed or `timeout_s` passed (tests, tools, shutdown)."""
        want = set(tickets)
        got: list[Completion] = []
        others: list[Completion] = []
        deadline = time.monotonic() + timeout_s
        while want and time.monotonic() < deadline:
            for c in self.poll():
                if c.ticket in want:
                    got.append(c)
                    want.discard(c.ticket)
                else:
                    others.append(c)
            if want:
                self._sock.poll(5)
        self._done = others + self._done  # the caller's next poll() still sees them
        return got

    def stats(self, timeout_s: float = 1.0) -> StatsReply | None:
        reply = self._ask(Stats(next(self._ids)), timeout_s)
        return reply if isinstance(reply, StatsReply) else None

    def clear(self, timeout_s: float = 30.0) -> int | None:
        """Remove every page of our namespace from the service's disk; None if unreachable."""
        reply = self._ask(Clear(next(self._ids)), timeout_s)
        return reply.removed if isinstance(reply, ClearReply) else None

    # -- internals ----------------------------------------------------------

    def _start(self, ticket: int, kind: TicketKind, n: int, request: Request) -> None:
        self._pump_monitor()
        deadline = time.monotonic() + self.config.ticket_timeout_s
        self._pending[ticket] = _Pending(kind, n, deadline, request)
        if not self.config.has_pool:
            self._fail(ticket, "no L2 pool registered with the storage client")
        elif not self._up:
            self._fail(ticket, "cache service unavailable")
        elif not self._send(request):
            self._fail(ticket, "cache service not accepting requests")

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
            self._send(Register(next(self._ids), cfg.namespace, cfg.segment, cfg.layout))

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
                for ticket in list(self._pending):
                    self._fail(ticket, "cache service disconnected")

    def _pump_replies(self) -> None:
        while True:
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_reply(decode(payload))
            except ValueError as exc:
                log.warning("storage client: bad reply dropped: %s", exc)

    def _on_reply(self, reply: Reply) -> None:
        if isinstance(reply, RegisterReply):
            self._registered = reply.error is None
            self._slots = reply.slots
            if reply.error:
                log.warning("cache service refused registration: %s", reply.error)
        elif isinstance(reply, LoadReply | StoreReply):
            remote = reply.pages_from_remote if isinstance(reply, LoadReply) else 0
            self._complete(reply.req_id, reply.pages_ok, reply.error, remote)
        elif isinstance(reply, ErrorReply) and reply.req_id in self._pending:
            self._retry_or_fail(reply)
        else:
            self._answers[reply.req_id] = reply
            if len(self._answers) > 1024:  # answers nobody waits for any more (timed out)
                self._answers.pop(next(iter(self._answers)))

    def _retry_or_fail(self, reply: ErrorReply) -> None:
        pending = self._pending[reply.req_id]
        if reply.code == "unregistered" and not pending.resent:
            pending.resent = True
            self._register()
            if self._send(pending.request):
                return
        self._fail(reply.req_id, f"{reply.code}: {reply.message}")

    def _complete(self, ticket: int, pages_ok: int, error: str | None, remote: int = 0) -> None:
        pending = self._pending.pop(ticket, None)
        if pending is not None:  # None: it already timed out or failed
            done = Completion(ticket, pending.kind, pages_ok, pending.requested, error, remote)
            self._done.append(done)

    def _fail(self, ticket: int, error: str) -> None:
        self._complete(ticket, 0, error)

    def _expire(self, now: float) -> None:
        for ticket in [t for t, p in self._pending.items() if p.deadline < now]:
            if self._up:
                self._send(Cancel(next(self._ids), ticket))
            self._fail(ticket, "timed out")
