"""The scheduler side's line to the cache service, on a thread of its own.

vLLM's scheduler must never wait on a socket, and `StorageClient.exists` is a
(short) request/reply. So one thread owns the `StorageClient`: the scheduler
drops commands in an inbox (`ask_exists`, `load`, `store`) and collects
events (`ExistsAnswer`, and the client's own `Completion` / `Settled` with the
job id in `ticket`) with a non-blocking `events()`. Commands carry the caller's
job ids; the link maps them to tickets.

The thread also keeps a service there: when none has answered for a while and
`start_service` is on, it starts one (`service_process`, one per address), and
it starts another if that one dies, so hits resume after a crash. While no
service answers, `exists` is 0 and tickets fail at once: vLLM recomputes.

It holds a lease on the service (storage.service.leases) for this process,
renewed every `_RENEW_S`, released at `close()`: the service lives while any
vLLM instance using it lives. The lease asks for the settings of the service
this connector would have started (with `start_service` off: none, it takes
the service as it runs); a service that runs with others refuses it, naming
them: `wait_connected` raises `ServiceConflict` at start-up, and later (a
service restarted by another instance) the link serves by recompute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_process import service_settings, spawn_service
from asynchicache.settings.config import GIB
from asynchicache.storage.base import Completion, PageLayout, PageRef, Settled
from asynchicache.storage.client.client_config import ClientConfig
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.messages import LeaseReply, ServiceSettings

log = logging.getLogger(__name__)

# Inbox waits (replies are polled in between): short while a load is in flight (a
# request waits on it), longer while only stores are (their completion only unpins
# slots; polling every 2 ms through a decode-heavy run, stores always in flight, took
# 17% of the engine core's CPU samples, and the GIL from vLLM's scheduler).
_BUSY_WAIT_S = 0.002
_STORE_WAIT_S = 0.02
_IDLE_WAIT_S = 0.05
_RESPAWN_AFTER_S = 1.0  # no service for this long: start one
_RESPAWN_EVERY_S = 5.0
_RENEW_S = 1.0  # lease heartbeat
LEASE_TTL_S = 30.0  # a lease not renewed for this long ends (a hung engine core)
_LEASE_WAIT_S = 0.5  # the link thread waits this long for a lease's answer
# Stores held while vLLM's step is compute-bound (`hold_stores`): a stored page costs
# the service ~1-4 ms of CPU (bench/micro/service_cpu.py), taken from vLLM's compute threads
# on a host whose cores they all use. Held at most this long, and this many pages
# (they keep their L2 slots pinned meanwhile).
_HOLD_MAX_S = 1.0
_HOLD_MAX_PAGES = 512

# The connector's keys for ServiceSettings' fields (what a conflict names).
_KEYS = {
    "disk_cache_dir": "disk_cache_dir",
    "disk_cache_bytes": "disk_cache_gb",
    "remote_url": "remote_url",
    "remote_ttl": "remote_ttl_s",
}


def _shown(name: str, settings: ServiceSettings) -> str:
    value = getattr(settings, name)
    if name == "disk_cache_bytes":
        return f"{value / GIB:g} GiB"
    return str(value)


class ServiceConflict(ValueError):
    """The service at the address runs with other settings than this connector's."""


def conflict_message(address: str, reply: LeaseReply, wanted: ServiceSettings | None) -> str:
    """Which settings differ, by the connector's key names, with both values."""
    parts = [
        f"{_KEYS.get(name, name)} (this instance: {_shown(name, wanted or reply.settings)}, "
        f"the service: {_shown(name, reply.settings)})"
        for name in reply.conflicts
    ]
    return (
        f"the asynchicache cache service at {address} (pid {reply.pid}, used by "
        f"{reply.holders} other instance(s)) runs with other settings: {'; '.join(parts)}. "
        "Use the same kv_connector_extra_config for every vLLM that shares a disk folder, "
        "or give this one another cache_service address (or disk_cache_dir)"
    )


@dataclass(frozen=True)
class ExistsAnswer:
    key: int
    pages: int


# Loads and stores report the client's own `Completion` and `Settled`, renumbered
# from the client's ticket to the link's job id (`ticket` holds the job id).
LinkEvent = ExistsAnswer | Completion | Settled


@dataclass(frozen=True)
class _Exists:
    key: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class _Load:
    job: int
    hashes: tuple[bytes, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class _Store:
    job: int
    pages: tuple[PageRef, ...]


@dataclass(frozen=True)
class _Cancel:
    job: int


class ServiceLink:
    """Owns a `StorageClient` registered with our L2 segment, on a private thread."""

    def __init__(
        self, config: ConnectorConfig, namespace: bytes, segment: str, layout: PageLayout
    ) -> None:
        self.config = config
        self._client_config = ClientConfig(
            address=config.service_address,
            namespace=namespace,
            segment=segment,
            layout=layout,
            # Loads are given up earlier by the scheduler side (prefetch_timeout_s,
            # then cancelled); their slots stay quarantined until the ticket ends.
            ticket_timeout_s=config.store_timeout_s,
            exists_timeout_s=config.lookup_timeout_s,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[LinkEvent] = queue.SimpleQueue()
        self._early: list[LinkEvent] = []  # taken by wait_events, handed out by events
        self._stop = threading.Event()
        self._connected = threading.Event()
        # What a service this connector would start runs with; one that starts none
        # takes the service as it is.
        self._settings = service_settings(config) if config.start_service else None
        self._conflict: str | None = None  # the service refused our lease (why)
        self._answered = threading.Event()  # leased or refused once
        self._proc: subprocess.Popen | None = None
        self._loading: set[int] = set()  # load tickets not completed (the link thread's)
        self._hold_until = 0.0  # stores wait until then (set by the scheduler's thread)
        self._held: list[_Store] = []  # the link thread's: stores not sent yet, oldest first
        self._held_since = 0.0
        self._thread = threading.Thread(target=self._run, name="asynchicache-link", daemon=True)
        self._thread.start()

    # -- the scheduler's side ----------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the service leased to us (start-up only, never on the scheduler
        path); raises `ServiceConflict` when it refused (another instance's settings)."""
        self._answered.wait(timeout_s)
        if self._conflict is not None:
            raise ServiceConflict(self._conflict)
        return self._connected.is_set()

    def ask_exists(self, key: int, hashes: Sequence[bytes]) -> None:
        self._inbox.put(_Exists(key, tuple(hashes)))

    def load(self, job: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        self._inbox.put(_Load(job, tuple(hashes), tuple(slots)))

    def store(self, job: int, pages: Sequence[PageRef]) -> None:
        self._inbox.put(_Store(job, tuple(pages)))

    def hold_stores(self, until: float) -> None:
        """Send no store before `until` (CLOCK_MONOTONIC; 0: send now), nor longer than
        `_HOLD_MAX_S` or past `_HOLD_MAX_PAGES` pages held: the step about to run is
        compute-bound, and the service's work would take its threads' cores."""
        self._hold_until = until

    def cancel(self, job: int) -> None:
        """Ask the service to skip `job` if it has not started; it still reports done."""
        self._inbox.put(_Cancel(job))

    def has_events(self) -> bool:
        """Whether `events()` would return something now."""
        return bool(self._early) or not self._outbox.empty()

    def wait_events(self, timeout_s: float) -> None:
        """Sleep until an event is there or `timeout_s` passed (a bounded yield)."""
        if self.has_events():
            return
        with contextlib.suppress(queue.Empty):
            self._early.append(self._outbox.get(timeout=timeout_s))

    def events(self) -> list[LinkEvent]:
        out, self._early = self._early, []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread and release the lease (the service finishes our stores, and
        exits if no other instance holds one)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._proc is not None:
            self._proc.poll()  # reap the launcher (it exits once the service detached)

    # -- the thread ----------------------------------------------------------

    def _run(self) -> None:
        client = StorageClient(self._client_config)
        tickets: dict[int, int] = {}  # ticket -> job
        down_since = time.monotonic()
        last_spawn = last_lease = 0.0
        leased = False
        try:
            while not self._stop.is_set():
                wait = self._wait_s(tickets)
                try:
                    self._handle(client, self._inbox.get(timeout=wait), tickets)
                    while True:
                        self._handle(client, self._inbox.get_nowait(), tickets)
                except queue.Empty:
                    pass
                self._send_held(client, tickets)
                for done in client.poll():
                    self._report(done, tickets)
                now = time.monotonic()
                if client.connected and now - last_lease > _RENEW_S:
                    last_lease = now
                    leased = self._lease(client, leased)
                if client.connected:
                    down_since = now
                else:  # a service that comes back is leased at once
                    leased, last_lease = False, 0.0
                if leased:
                    self._connected.set()
                else:
                    self._connected.clear()
                    if self._should_spawn(now - down_since, now - last_spawn):
                        last_spawn = now
                        self._spawn()
        except Exception:  # the link must not die silently: log, and stop answering hits
            log.exception("asynchicache service link failed; serving by recompute from now on")
            self._connected.clear()
        finally:
            self._send_held(client, tickets, everything=True)
            if leased:
                client.release(_LEASE_WAIT_S)
            client.close()

    def _lease(self, client: StorageClient, leased: bool) -> bool:
        """Take or renew our lease; whether we hold one now (no answer: as before)."""
        reply = client.lease(os.getpid(), self._settings, LEASE_TTL_S, _LEASE_WAIT_S)
        if reply is None:
            return leased
        if reply.granted:
            self._conflict = None
        else:
            self._conflict = conflict_message(self.config.service_address, reply, self._settings)
            if leased or not self._answered.is_set():
                log.error("%s", self._conflict)
        self._answered.set()
        return reply.granted

    def _wait_s(self, tickets: dict[int, int]) -> float:
        if self._loading:
            return _BUSY_WAIT_S
        if self._held:
            return min(_STORE_WAIT_S, max(0.0, self._hold_until - time.monotonic()))
        return _STORE_WAIT_S if tickets else _IDLE_WAIT_S

    def _handle(self, client: StorageClient, cmd: object, tickets: dict[int, int]) -> None:
        if isinstance(cmd, _Exists):
            pages = client.exists(cmd.hashes) if client.connected else 0
            self._outbox.put(ExistsAnswer(cmd.key, pages))
        elif isinstance(cmd, _Load):
            ticket = client.submit_load(cmd.hashes, cmd.slots)
            tickets[ticket] = cmd.job
            self._loading.add(ticket)
        elif isinstance(cmd, _Store):
            if not self._held:
                self._held_since = time.monotonic()
            self._held.append(cmd)  # sent by _send_held, now or once the step is over
        elif isinstance(cmd, _Cancel):
            for ticket, job in tickets.items():
                if job == cmd.job:
                    client.cancel(ticket)

    def _send_held(
        self, client: StorageClient, tickets: dict[int, int], everything: bool = False
    ) -> None:
        """Send the held stores once the hold ended, ran too long or holds too much."""
        if not self._held:
            return
        now = time.monotonic()
        pages = sum(len(cmd.pages) for cmd in self._held)
        if not (
            everything
            or now >= self._hold_until
            or now - self._held_since >= _HOLD_MAX_S
            or pages >= _HOLD_MAX_PAGES
        ):
            return
        for cmd in self._held:
            tickets[client.submit_store(cmd.pages)] = cmd.job
        self._held = []

    def _report(self, done: Completion | Settled, tickets: dict[int, int]) -> None:
        self._loading.discard(done.ticket)
        if isinstance(done, Settled):
            job = tickets.pop(done.ticket, None)
            if job is not None:
                self._outbox.put(replace(done, ticket=job))
            return
        job = tickets.get(done.ticket)
        if job is None:
            return
        if done.settled:
            del tickets[done.ticket]
        self._outbox.put(replace(done, ticket=job))

    def _should_spawn(self, down_for: float, since_spawn: float) -> bool:
        if not self.config.start_service or down_for < _RESPAWN_AFTER_S:
            return False
        running = self._proc is not None and self._proc.poll() is None
        return not running and since_spawn > _RESPAWN_EVERY_S

    def _spawn(self) -> None:
        try:
            self._proc = spawn_service(self.config)
        except OSError as exc:
            log.warning("cannot start the asynchicache cache service: %s", exc)
