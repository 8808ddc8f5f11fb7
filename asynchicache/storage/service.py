"""The cache service: one process per machine that owns L3 and L4 for its engines.

    python -m asynchicache.storage.service --disk-cache-dir DIR [--socket ipc://...]

A ZeroMQ ROUTER (default: `ipc://` in a private 0700 runtime folder) takes
msgpack messages from `StorageClient`s (DEALER). A client registers its
namespace, its L2 segment name and its page layout; the service maps the
segment (zero-copy numpy view) and moves pages between the disk and L2 slots.
Only hashes, slot numbers and statuses cross the socket.

`Exists` is answered from the in-memory index on the loop thread. Loads,
stores and clears run on a worker pool and reply when done; workers hand their
replies back through a queue and a wake-up pipe, because a ZeroMQ socket
belongs to one thread. A client that vanished costs nothing: its replies are
dropped (counted). A worker that fails logs, counts and replies with an error;
the loop keeps going.

Slot lifetimes (the client quarantines a slot until this says it is free):

* a Load or Store carries the client's absolute deadline (CLOCK_MONOTONIC);
  its job checks it, and its cancel flag, before every page it reads, writes
  or copies, so neither time spent queued nor a `Cancel` lets work run on;
* a store's slots are copied once, up front; everything after works from
  the copy (`storage.tiered`);
* every Load and Store gets exactly one final reply, sent only when its job
  touches the client's slots no more (a job that fails waits for its pages in
  flight first);
* `Cancel` skips a job not started (answered `settled`), stops a running one
  at its next page (its final reply follows), and refuses a ticket it has
  not seen yet, should it still arrive (answered `settled`);
* `RegisterReply` carries this process's pid: a client whose service died
  knows its slots are free.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import queue
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from asynchicache.config import GIB, CacheConfig, ServiceTuning
from asynchicache.storage.base import PageLayout
from asynchicache.storage.deadline import Deadline
from asynchicache.storage.disk import DiskConfig, SyncMode
from asynchicache.storage.fileio import make_private_dir
from asynchicache.storage.messages import (
    Cancel,
    CancelReply,
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
    Stats,
    StatsReply,
    Store,
    StoreReply,
    decode,
    encode,
)
from asynchicache.storage.shm import SharedSegment, owner_pid
from asynchicache.storage.tiered import RemoteTierConfig, TieredBackend, open_tiered

log = logging.getLogger(__name__)

_POLL_MS = 100
_MAX_BATCH = 256  # requests taken per loop turn before replies get their turn
_REFUSED_PER_CLIENT = 4096  # cancelled tickets remembered per client, should they still come
_REFUSED_CLIENTS = 256


def default_runtime_dir() -> Path:
    """A per-user private folder for sockets: $XDG_RUNTIME_DIR or the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"asynchicache-{os.getuid()}"


def default_address() -> str:
    return f"ipc://{default_runtime_dir() / 'cache.sock'}"


def prepare_address(address: str) -> None:
    """Create the private (0700) folder of an `ipc://` address, refusing a foreign one."""
    if not address.startswith("ipc://"):
        return
    folder = Path(address[len("ipc://") :]).parent
    make_private_dir(folder)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"socket folder {folder} must be private to this user")


@dataclass(frozen=True)
class ServiceConfig:
    """The cache service: where pages live, where it listens, how hard it works."""

    disk_cache_dir: Path
    address: str = field(default_factory=default_address)
    capacity_bytes: int = int(CacheConfig.disk_cache_gb * GIB)
    io_threads: int = ServiceTuning.io_threads
    workers: int = ServiceTuning.workers
    sync: SyncMode = SyncMode(ServiceTuning.disk_sync)  # noqa: RUF009 (an immutable enum member)
    direct_io: bool = True
    client_ttl_s: float = ServiceTuning.client_ttl_s  # a client silent this long is dropped
    remote: RemoteTierConfig | None = None  # L4 (Redis/Valkey) behind the disk: --remote-url

    def __post_init__(self) -> None:
        object.__setattr__(self, "disk_cache_dir", Path(self.disk_cache_dir))
        if self.capacity_bytes <= 0:
            raise ValueError(f"--disk-cache-gb must be positive, got {self.capacity_bytes} bytes")
        if self.workers <= 0 or self.io_threads <= 0:
            raise ValueError("--workers and --io-threads must be positive")
        if "://" not in self.address:
            raise ValueError(
                f"--socket must be a ZeroMQ address like ipc://PATH, got {self.address}"
            )
        _check_local(self.address)


def _check_local(address: str) -> None:
    """The service trusts whoever connects (it maps their segments, writes their pages):
    it listens on an ipc:// file in a private folder, or on loopback TCP, nowhere else."""
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        return
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a host name: not provably local
        loopback = False
    if scheme != "tcp" or not loopback:
        raise ValueError(
            f"--socket must be ipc://PATH or tcp://127.0.0.1:PORT (the service has no "
            f"authentication), got {address}"
        )


@dataclass
class _Client:
    """A registered engine: its namespace's backend and its L2 pool view."""

    segment: str
    backend: TieredBackend
    pool: np.ndarray  # [slots, page_bytes] uint8 view of the client's L2 segment
    last_seen: float


@dataclass
class _Job:
    """A Load/Store/Clear on the worker pool: its future and its stop condition."""

    future: Future
    deadline: Deadline


class CacheService:
    """The service loop; `run()` blocks until `stop` is set."""

    def __init__(self, config: ServiceConfig, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self._clients: dict[bytes, _Client] = {}
        self._segments: dict[str, tuple[SharedSegment, int]] = {}
        self._backends: dict[tuple[bytes, PageLayout], TieredBackend] = {}
        self._running: dict[tuple[bytes, int], _Job] = {}
        # Tickets cancelled before they arrived (per client): refused if they still do.
        self._refused: OrderedDict[bytes, OrderedDict[int, None]] = OrderedDict()
        self._done: queue.SimpleQueue[tuple[bytes, Reply]] = queue.SimpleQueue()
        self._counters: dict[str, float] = {}
        self._workers = ThreadPoolExecutor(config.workers, thread_name_prefix="cache-worker")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises: count it
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
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
                if time.monotonic() - last_sweep > 1.0:
                    self._sweep_clients()
                    last_sweep = time.monotonic()
        finally:
            self._shutdown()

    def _take_requests(self) -> None:
        for _ in range(_MAX_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
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
        elif isinstance(msg, Cancel):
            self._send(ident, CancelReply(msg.req_id, msg.target, self._cancel(ident, msg.target)))
        elif client is None:
            self._send(ident, ErrorReply(msg.req_id, "unregistered", "send Register first"))
        elif isinstance(msg, Exists):
            self._send(ident, ExistsReply(msg.req_id, client.backend.exists(msg.hashes)))
        elif isinstance(msg, Load | Store | Clear):
            self._submit(ident, client, msg)
        else:  # a reply type sent as a request
            self._send(ident, ErrorReply(msg.req_id, "malformed", type(msg).__name__))

    # -- registration ---------------------------------------------------------

    def _register(self, ident: bytes, msg: Register) -> RegisterReply:
        old = self._clients.get(ident)
        same = old is not None and old.segment == msg.segment
        if same and old.backend.layout == msg.layout and old.backend.namespace == msg.namespace:
            return RegisterReply(msg.req_id, old.pool.shape[0], pid=os.getpid())  # a heartbeat
        try:
            backend = self._backend(msg.namespace, msg.layout)
            segment = self._attach(msg.segment)
        except (OSError, ValueError) as exc:
            log.warning("cache service: cannot register %s: %s", msg.segment, exc)
            return RegisterReply(msg.req_id, 0, str(exc), os.getpid())
        slots = segment.size // msg.layout.page_bytes
        if slots == 0:
            self._detach(msg.segment)
            return RegisterReply(msg.req_id, 0, "segment smaller than one page", os.getpid())
        pool = segment.as_array()[: slots * msg.layout.page_bytes].reshape(slots, -1)
        if old is not None:
            self._drop_client(ident)
        self._clients[ident] = _Client(msg.segment, backend, pool, time.monotonic())
        log.info("cache service: client registered segment %s (%d slots)", msg.segment, slots)
        return RegisterReply(msg.req_id, slots, pid=os.getpid())

    def _backend(self, namespace: bytes, layout: PageLayout) -> TieredBackend:
        key = (namespace, layout)
        if key not in self._backends:
            cfg = self.config
            self._backends[key] = open_tiered(
                DiskConfig(
                    cfg.disk_cache_dir,
                    namespace,
                    layout,
                    cfg.capacity_bytes,
                    io_threads=cfg.io_threads,
                    sync=cfg.sync,
                    direct_io=cfg.direct_io,
                ),
                cfg.remote,
            )
        return self._backends[key]

    def _attach(self, name: str) -> SharedSegment:
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad segment name {name!r}")
        segment, users = self._segments.get(name) or (SharedSegment.attach(name), 0)
        self._segments[name] = (segment, users + 1)
        return segment

    def _detach(self, name: str) -> None:
        segment, users = self._segments[name]
        if users > 1:
            self._segments[name] = (segment, users - 1)
            return
        del self._segments[name]
        segment.close()  # running workers keep their views; the mapping goes with them

    def _drop_client(self, ident: bytes) -> None:
        client = self._clients.pop(ident)
        self._detach(client.segment)

    def _sweep_clients(self) -> None:
        """Forget clients that stopped talking or whose pool's owner died."""
        now = time.monotonic()
        for ident, client in list(self._clients.items()):
            pid = owner_pid(client.segment)
            gone = pid is not None and not _pid_alive(pid)
            if gone or now - client.last_seen > self.config.client_ttl_s:
                log.info("cache service: dropping client of segment %s", client.segment)
                self._drop_client(ident)
                self._count("clients_dropped")

    # -- work -------------------------------------------------------------

    def _submit(self, ident: bytes, client: _Client, msg: Load | Store | Clear) -> None:
        key = (ident, msg.req_id)
        refused = self._refused.get(ident)
        if not isinstance(msg, Clear) and refused is not None and msg.req_id in refused:
            del refused[msg.req_id]
            self._count("refused_cancelled")
            self._send(ident, _failed(msg, "cancelled"))
            return
        deadline = Deadline(None if isinstance(msg, Clear) else msg.deadline_ns)
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

    def _guarded(self, msg: Load | Store | Clear, client: _Client, deadline: Deadline) -> Reply:
        if deadline.passed():
            why = "cancelled" if deadline.cancelled else "expired before it started"
            self._count("cancelled" if deadline.cancelled else "expired")
            return _failed(msg, why)
        try:
            return _execute(msg, client, deadline)
        except Exception as exc:
            log.exception("cache worker failed on %s", type(msg).__name__)
            self._count("worker_failures")
            return _failed(msg, f"worker failed: {exc}")

    def _finished(self, ident: bytes, msg: Load | Store | Clear, future: Future) -> None:
        # Runs on the worker thread (or the loop thread for a cancel).
        reply = _failed(msg, "cancelled") if future.cancelled() else future.result()
        self._done.put((ident, reply))
        os.write(self._wake_w, b"x")

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

    def _send(self, ident: bytes, reply: Reply) -> None:
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
        }

    def _shutdown(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._send_done()
        for backend in self._backends.values():
            backend.close()
        for ident in list(self._clients):
            self._drop_client(ident)
        self._sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        log.info("cache service stopped")


def _execute(msg: Load | Store | Clear, client: _Client, deadline: Deadline) -> Reply:
    if isinstance(msg, Load):
        read = client.backend.load(msg.hashes, msg.slots, client.pool, deadline)
        ok, n = read.pages_ok, len(msg.hashes)
        error = None if ok == n else f"{n - ok} of {n} pages missed"
        return LoadReply(msg.req_id, ok, n, error, read.pages_from_remote)
    if isinstance(msg, Store):
        ok = client.backend.put(msg.pages, client.pool, deadline)
        n = len(msg.pages)
        return StoreReply(msg.req_id, ok, n, None if ok == n else f"{n - ok} of {n} not stored")
    return ClearReply(msg.req_id, client.backend.clear())


def _failed(msg: Load | Store | Clear, error: str) -> Reply:
    if isinstance(msg, Load):
        return LoadReply(msg.req_id, 0, len(msg.hashes), error)
    if isinstance(msg, Store):
        return StoreReply(msg.req_id, 0, len(msg.pages), error)
    return ErrorReply(msg.req_id, "internal", error)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_service(config: ServiceConfig, stop: threading.Event | None = None) -> None:
    """Run the service until `stop` is set (a launcher's multiprocessing/thread target)."""
    CacheService(config, stop).run()


def _parse(argv: list[str] | None) -> ServiceConfig:
    p = argparse.ArgumentParser(
        prog="asynchicache-cache-service", description=__doc__.split("\n")[0]
    )
    p.add_argument("--disk-cache-dir", type=Path, required=True)
    p.add_argument("--socket", default=default_address(), help="ZeroMQ address to bind")
    p.add_argument(
        "--disk-cache-gb",
        type=float,
        default=CacheConfig.disk_cache_gb,
        help="L3 capacity in GiB (2**30 bytes)",
    )
    p.add_argument(
        "--io-threads",
        type=int,
        default=ServiceTuning.io_threads,
        help="parallel file I/O per namespace",
    )
    p.add_argument(
        "--workers", type=int, default=ServiceTuning.workers, help="requests served at once"
    )
    p.add_argument(
        "--disk-sync",
        choices=[m.value for m in SyncMode],
        default=ServiceTuning.disk_sync,
        help="durability of stored pages: one syncfs per put, fdatasync per file, or none",
    )
    p.add_argument("--no-direct-io", action="store_true", help="never use O_DIRECT")
    p.add_argument(
        "--client-ttl",
        type=float,
        default=ServiceTuning.client_ttl_s,
        help="forget silent clients (s)",
    )
    p.add_argument("--remote-url", help="L4 Redis/Valkey, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--remote-ttl", type=int, help="L4 value expiry in seconds (default: none)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    return ServiceConfig(
        a.disk_cache_dir,
        a.socket,
        int(a.disk_cache_gb * GIB),
        a.io_threads,
        a.workers,
        sync=SyncMode(a.disk_sync),
        direct_io=not a.no_direct_io,
        client_ttl_s=a.client_ttl,
        remote=RemoteTierConfig(a.remote_url, a.remote_ttl) if a.remote_url else None,
    )


def main(argv: list[str] | None = None) -> int:
    config = _parse(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_service(config, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
