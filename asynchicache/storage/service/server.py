"""The cache service: one process per machine that owns L3 and L4 for its engines.

    asynchicache service --disk-cache-dir DIR [--address ipc://...]

A ZeroMQ ROUTER (default: `ipc://` in a private 0700 runtime folder) takes
msgpack messages from `StorageClient`s (DEALER). A client registers its
namespace, its L2 segment name and its page layout; the service maps the
segment (zero-copy numpy view) and moves pages between the disk and L2 slots.
Only hashes, slot numbers and statuses cross the socket.

`Exists` is answered from the in-memory index on the loop thread (an index
miss looks at the folder: storage.disk.disk_backend); the loop never talks to
Redis: when L4 may hold the rest of the chain, a lookup thread asks it and
replies (storage.service.remote_lookups: bounded, a slow Redis degrades to
misses).
Loads, stores, clears, pins and
contents run on a worker pool (storage.service.service_jobs) and reply when done; workers hand their
replies back through a queue and a wake-up pipe, because a ZeroMQ socket
belongs to one thread. A client that vanished costs nothing: its replies are
dropped (counted). A worker that fails logs, counts and replies with an error;
the loop keeps going.

Slot lifetimes (the client quarantines a slot until this says it is free):

* a Load or Store carries the client's absolute deadline (CLOCK_MONOTONIC);
  its job checks it, and its cancel flag, before every page it reads, writes
  or copies, so neither time spent queued nor a `Cancel` lets work run on;
* a store's slots are copied once, up front; everything after works from
  the copy (`storage.service.tiered`);
* every Load and Store gets exactly one final reply, sent only when its job
  touches the client's slots no more (a job that fails waits for its pages in
  flight first);
* `Cancel` skips a job not started (answered `settled`), stops a running one
  at its next page (its final reply follows), and refuses a ticket it has
  not seen yet, should it still arrive (answered `settled`);
* `RegisterReply` carries this process's pid: a client whose service died
  knows its slots are free.

KV events (storage.events): each namespace's backend numbers its L3/L4
changes; a client that registered with `events=True` gets them, in order, as
`StorageEvents` sent by the loop thread whenever some are waiting.

Leases (storage.service.leases): engines that share the service hold leases
(`Lease`, renewed as a heartbeat; `Release`); a service started `--leased-by`
its vLLM starter stops once none is held and no work is in flight. A client
dropped because its pool's owner died gets its segment unlinked (a SIGKILLed
vLLM engine core never removes its own).

Configuration: storage.service.service_config; the process's command line:
storage.service.service_cli (`asynchicache service`); mapped L2 segments:
storage.service.segments.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zmq

from asynchicache.common.curve import CurveGuard
from asynchicache.common.deadline import Deadline
from asynchicache.common.liveness import pid_alive
from asynchicache.common.shm import owner_pid
from asynchicache.common.sockets import queued
from asynchicache.common.tiers import TierEvent
from asynchicache.storage.admin_messages import StorageEvents
from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.disk_backend import DiskConfig
from asynchicache.storage.messages import (
    Cancel,
    CancelReply,
    ErrorReply,
    Exists,
    Lease,
    Load,
    Register,
    RegisterReply,
    Release,
    Reply,
    Stats,
    StatsReply,
    Store,
    decode,
    encode,
)
from asynchicache.storage.page_keys import PageKeys
from asynchicache.storage.service.leases import LeaseDesk
from asynchicache.storage.service.remote_lookups import RemoteLookups
from asynchicache.storage.service.segments import MappedSegments
from asynchicache.storage.service.service_config import (
    ServiceConfig,
    default_address,
    default_runtime_dir,
    prepare_address,
)
from asynchicache.storage.service.service_jobs import Work, execute, failed
from asynchicache.storage.service.tiered import TieredBackend, open_tiered

__all__ = [
    "CacheService",
    "ServiceConfig",
    "default_address",
    "default_runtime_dir",
    "prepare_address",
    "run_service",
]

log = logging.getLogger(__name__)

_POLL_MS = 100
_MAX_BATCH = 256  # requests taken per loop turn before replies get their turn
_REFUSED_PER_CLIENT = 4096  # cancelled tickets remembered per client, should they still come
_REFUSED_CLIENTS = 256
_EVENTS_PER_MESSAGE = 512
_FLUSH_MS = 1000  # at exit, replies queued for clients get this long to leave
_SWEEP_S = 0.5  # clients and leases whose process died are seen this often


@dataclass
class _Client:
    """A registered engine: its namespace's backend and its L2 pool view."""

    segment: str
    backend: TieredBackend
    pool: np.ndarray  # [slots, page_bytes] uint8 view of the client's L2 segment
    last_seen: float
    events: bool = False  # sent this namespace's StorageEvents
    events_from: int = 0  # the event number its subscription started after


@dataclass
class _Job:
    """A request on the worker pool: its future and its stop condition."""

    future: Future[Reply]
    deadline: Deadline


class CacheService:
    """The service loop; `run()` blocks until `stop` is set."""

    def __init__(self, config: ServiceConfig, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self._clients: dict[bytes, _Client] = {}
        self._segments = MappedSegments()
        self._backends: dict[tuple[bytes, PageLayout], TieredBackend] = {}
        self._running: dict[tuple[bytes, int], _Job] = {}
        # Tickets cancelled before they arrived (per client): refused if they still do.
        self._refused: OrderedDict[bytes, OrderedDict[int, None]] = OrderedDict()
        self._done: queue.SimpleQueue[tuple[bytes, Reply]] = queue.SimpleQueue()
        self._counters: dict[str, float] = {}
        self._leases = LeaseDesk(config.settings, config.leased_by, time.monotonic())
        # A bad key file stops the start, before anything listens.
        self._keys = (
            PageKeys.load(config.cache_key_file, config.cache_encrypt)
            if config.cache_key_file is not None
            else None
        )
        self._workers = ThreadPoolExecutor(config.workers, thread_name_prefix="cache-worker")
        self._lookups = RemoteLookups(self._send, self._send_later, self._count)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises: count it
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        # tcp:// only with CURVE (ServiceConfig refuses it otherwise): listed clients only.
        self._guard = CurveGuard(self._ctx, config.curve) if config.curve is not None else None
        if self._guard is not None:
            self._guard.secure(self._sock)
        prepare_address(config.address)
        self._sock.bind(config.address)
        log.info(
            "cache service listening on %s, disk cache %s", config.address, config.disk_cache_dir
        )

    # -- loop -------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self.stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self._sock in events:
                    self._take_requests()
                if self._wake_r in events:
                    self._send_done()
                    self._send_events()
                if time.monotonic() - last_sweep > _SWEEP_S:
                    self._sweep_clients()
                    self._stop_when_unleased()
                    last_sweep = time.monotonic()
        finally:
            self._shutdown()

    def _take_requests(self) -> None:
        for frames in itertools.islice(queued(self._sock.recv_multipart), _MAX_BATCH):
            if len(frames) != 2:
                self._count("malformed")
                continue
            ident, payload = frames
            try:
                self._handle(ident, payload)
            except Exception as exc:
                log.exception("cache service: request failed")
                self._count("handler_failures")
                self._send(ident, ErrorReply(0, "internal", str(exc)))

    def _handle(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except ValueError as exc:
            self._count("malformed")
            self._send(ident, ErrorReply(0, "malformed", str(exc)))
            return
        self._count("requests")
        client = self._clients.get(ident)
        if client is not None:
            client.last_seen = time.monotonic()
        if isinstance(msg, Register):
            self._send(ident, self._register(ident, msg))
        elif isinstance(msg, Stats):
            disk = client.backend.stats() if client else None
            remote = client.backend.remote_stats() if client else None
            self._send(ident, StatsReply(msg.req_id, disk, self._service_stats(), remote))
        elif isinstance(msg, Lease | Release):
            self._send(ident, self._leases.answer(ident, msg, time.monotonic()))
        elif isinstance(msg, Cancel):
            self._send(ident, CancelReply(msg.req_id, msg.target, self._cancel(ident, msg.target)))
        elif client is None:
            self._send(ident, ErrorReply(msg.req_id, "unregistered", "send Register first"))
        elif isinstance(msg, Exists):
            self._lookups.exists(ident, client.backend, msg)
        elif isinstance(msg, Work):
            self._submit(ident, client, msg)
        else:  # a reply type sent as a request
            self._send(ident, ErrorReply(msg.req_id, "malformed", type(msg).__name__))

    # -- registration ---------------------------------------------------------

    def _register(self, ident: bytes, msg: Register) -> RegisterReply:
        old = self._clients.get(ident)
        if (
            old is not None
            and old.segment == msg.segment
            and old.backend.layout == msg.layout
            and old.backend.namespace == msg.namespace
        ):
            self._subscribe(old, msg.events)  # a heartbeat
            return RegisterReply(msg.req_id, old.pool.shape[0], None, os.getpid(), self._seq(old))
        try:
            backend = self._backend(msg.namespace, msg.layout)
            segment = self._segments.attach(msg.segment)
        except (OSError, ValueError) as exc:
            log.warning("cache service: cannot register %s: %s", msg.segment, exc)
            return RegisterReply(msg.req_id, 0, str(exc), os.getpid())
        slots = segment.size // msg.layout.page_bytes
        if slots == 0:
            self._segments.detach(msg.segment)
            return RegisterReply(msg.req_id, 0, "segment smaller than one page", os.getpid())
        pool = segment.as_array()[: slots * msg.layout.page_bytes].reshape(slots, -1)
        if old is not None:
            self._drop_client(ident)
        client = _Client(msg.segment, backend, pool, time.monotonic())
        self._subscribe(client, msg.events)
        self._clients[ident] = client
        log.info("cache service: client registered segment %s (%d slots)", msg.segment, slots)
        return RegisterReply(msg.req_id, slots, None, os.getpid(), self._seq(client))

    def _subscribe(self, client: _Client, events: bool) -> None:
        if events and not client.events:
            client.backend.events.enable(self._wake)
            client.events_from = client.backend.events.seq
        client.events = events

    def _seq(self, client: _Client) -> int:
        return client.events_from

    def _backend(self, namespace: bytes, layout: PageLayout) -> TieredBackend:
        key = (namespace, layout)
        if key not in self._backends:
            self._backends[key] = open_tiered(
                self._disk_config(namespace, layout),
                self.config.remote,
                remote_jobs=max(1, self.config.workers // 2),  # the rest serve disk loads
            )
        return self._backends[key]

    def _disk_config(self, namespace: bytes, layout: PageLayout) -> DiskConfig:
        cfg = self.config
        return DiskConfig(
            cfg.disk_cache_dir,
            namespace,
            layout,
            cfg.disk_cache_bytes,
            io_threads=cfg.io_threads,
            disk_sync=cfg.disk_sync,
            direct_io=cfg.direct_io,
            max_pinned_fraction=cfg.max_pinned_fraction,
            keys=self._keys,
        )

    def _drop_client(self, ident: bytes) -> None:
        client = self._clients.pop(ident)
        self._segments.detach(client.segment)

    def _sweep_clients(self) -> None:
        """Forget clients that stopped talking or whose pool's owner died."""
        now = time.monotonic()
        for ident, client in list(self._clients.items()):
            pid = owner_pid(client.segment)
            gone = pid is not None and not pid_alive(pid)
            if gone or now - client.last_seen > self.config.client_ttl_s:
                log.info("cache service: dropping client of segment %s", client.segment)
                self._drop_client(ident)
                self._count("clients_dropped")

    def _stop_when_unleased(self) -> None:
        """A leased service whose last lease ended stops once its work in flight is done
        (a lease that comes meanwhile keeps it running)."""
        if self._leases.unleased(time.monotonic()) and not self._running:
            log.info("cache service: no lease held and no work in flight; stopping")
            self.stop.set()

    # -- work -------------------------------------------------------------

    def _submit(self, ident: bytes, client: _Client, msg: Work) -> None:
        key = (ident, msg.req_id)
        refused = self._refused.get(ident)
        slots = isinstance(msg, Load | Store)
        if slots and refused is not None and msg.req_id in refused:
            del refused[msg.req_id]
            self._count("refused_cancelled")
            self._send(ident, failed(msg, "cancelled"))
            return
        deadline = Deadline(msg.deadline_ns if isinstance(msg, Load | Store) else None)
        future = self._workers.submit(self._guarded, msg, client, deadline)
        self._running[key] = _Job(future, deadline)
        future.add_done_callback(lambda f: self._finished(ident, msg, f))

    def _cancel(self, ident: bytes, target: int) -> bool:
        """Stop `target`; True when it will never touch its slots (see the module docstring)."""
        job = self._running.get((ident, target))
        if job is None:  # done and answered (the reply went first), or not here yet
            refused = self._refused.setdefault(ident, OrderedDict())
            self._refused.move_to_end(ident)
            refused[target] = None
            while len(refused) > _REFUSED_PER_CLIENT:
                refused.popitem(last=False)
            while len(self._refused) > _REFUSED_CLIENTS:
                self._refused.popitem(last=False)
            return True
        job.deadline.cancel()
        if job.future.cancel():  # never started: its "cancelled" reply is queued already
            self._count("cancelled_waiting")
            return True
        self._count("cancelled_running")
        return False

    def _guarded(self, msg: Work, client: _Client, deadline: Deadline) -> Reply:
        if deadline.passed():
            why = "cancelled" if deadline.cancelled else "expired before it started"
            self._count("cancelled" if deadline.cancelled else "expired")
            return failed(msg, why)
        try:
            return execute(msg, client.backend, client.pool, deadline)
        except Exception as exc:
            log.exception("cache worker failed on %s", type(msg).__name__)
            self._count("worker_failures")
            return failed(msg, f"worker failed: {exc}")

    def _finished(self, ident: bytes, msg: Work, future: Future[Reply]) -> None:
        # Runs on the worker thread (or the loop thread for a cancel).
        reply = failed(msg, "cancelled") if future.cancelled() else future.result()
        self._send_later(ident, reply)

    def _send_later(self, ident: bytes, reply: Reply) -> None:
        """Queue a reply for the loop thread to send (any thread)."""
        self._done.put((ident, reply))
        self._wake()

    def _wake(self) -> None:
        """Make the loop look at finished jobs and waiting events (any thread)."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _send_events(self) -> None:
        """Send each namespace's waiting events to its subscribed clients, in order."""
        for backend in self._backends.values():
            numbered = backend.events.drain()
            if not numbered:
                continue
            to = [i for i, c in self._clients.items() if c.events and c.backend is backend]
            for seq, events in _runs(numbered):
                for ident in to:
                    self._send(ident, StorageEvents(0, seq, events))
            self._count("events_sent", len(numbered) * len(to))

    def _send_done(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                ident, reply = self._done.get_nowait()
            except queue.Empty:
                return
            self._running.pop((ident, reply.req_id), None)
            self._send(ident, reply)

    def _send(self, ident: bytes, reply: Reply | StorageEvents) -> None:
        try:
            self._sock.send_multipart([ident, encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client left; EAGAIN: it stopped reading
            self._count("replies_dropped")
            log.debug("cache service: reply %d dropped: %s", reply.req_id, exc)

    def _count(self, name: str, delta: float = 1.0) -> None:
        self._counters[name] = self._counters.get(name, 0.0) + delta

    def _service_stats(self) -> dict[str, float]:
        return {
            **self._counters,
            "clients": float(len(self._clients)),
            "backends": float(len(self._backends)),
            "running": float(len(self._running)),
            **self._leases.stats(),
        }

    def _shutdown(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._lookups.shutdown()
        self._send_done()
        for backend in self._backends.values():
            backend.close()
        for ident in list(self._clients):
            self._drop_client(ident)
        self._sock.close(linger=_FLUSH_MS)  # the last replies still reach live clients
        if self._guard is not None:
            self._guard.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        log.info("cache service stopped")


def _runs(numbered: list[tuple[int, TierEvent]]) -> list[tuple[int, tuple[TierEvent, ...]]]:
    """Events as (first number, events) runs of consecutive numbers, each of a bounded size."""
    runs: list[tuple[int, list[TierEvent]]] = []
    for seq, event in numbered:
        if (
            runs
            and runs[-1][0] + len(runs[-1][1]) == seq
            and len(runs[-1][1]) < _EVENTS_PER_MESSAGE
        ):
            runs[-1][1].append(event)
        else:
            runs.append((seq, [event]))
    return [(seq, tuple(events)) for seq, events in runs]


def run_service(config: ServiceConfig, stop: threading.Event | None = None) -> None:
    """Run the service until `stop` is set (a launcher's multiprocessing/thread target)."""
    CacheService(config, stop).run()
