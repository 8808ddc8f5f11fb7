"""The settlement contract of `StorageClient.poll()` against a real service process.

Every ticket yields one `Completion`; one with `settled=False` (the client gave
up while the service may still touch its slots) later yields exactly one
`Settled`: on the late reply, on a cancel the service acknowledges, or when the
service process is gone. Slots are never written after their ticket settled.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq
from pools import NAMESPACE, SMALL, Pool, new_hashes, pool_factory, refs
from service_process import ServiceProcess
from storage_clients import Clients, wait_idle

from asynchicache.storage.base import Completion, Settled
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.messages import (
    Cancel,
    CancelReply,
    Load,
    LoadReply,
    Register,
    RegisterReply,
    decode,
    encode,
)
from asynchicache.storage.service.in_thread import client_in_thread
from asynchicache.storage.service.server import ServiceConfig

MANY = 20_000  # 1 KiB pages: one I/O thread needs seconds for them
MARK = 0x5A


@pytest.fixture(scope="module")
def stored_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    """A disk folder holding MANY pages (the first MANY slots of a pool filled with seed 5).

    Written once for the module (MANY page files take seconds): the tests only load
    these pages, and each test's service and pool are its own.
    """
    folder = tmp_path_factory.mktemp("settlement") / "kv"
    hashes = new_hashes(MANY)
    for make_pool in pool_factory():
        pool = make_pool(MANY, fill=MANY, seed=5)
        disk = DiskBackend(DiskConfig(folder, NAMESPACE, SMALL, 1 << 34))
        try:
            assert disk.put(refs(hashes, range(MANY)), pool.array) == MANY
        finally:
            disk.close()
    return folder, hashes


@pytest.fixture
def stored(
    stored_folder: tuple[Path, list[bytes]], make_pool: Callable[..., Pool]
) -> tuple[Pool, list[bytes]]:
    """A pool of 2 x MANY slots whose first MANY pages are on disk in `stored_folder`."""
    return make_pool(2 * MANY, fill=MANY, seed=5), stored_folder[1]


def _slow_service(services, folder: Path, sock_dir: Path) -> tuple[ServiceProcess, str]:
    addr = f"ipc://{sock_dir}/svc.sock"
    return services(folder, addr, "--workers", "1", "--io-threads", "1"), addr


def _events(client: StorageClient, seconds: float) -> list[Completion | Settled]:
    """Everything poll() reports during `seconds`."""
    got: list[Completion | Settled] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got += client.poll()
        time.sleep(0.01)
    return got


def _wait_running(client: StorageClient) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.stats(5.0)
        if stats is not None and stats.service.get("running", 0) >= 1:
            return
    raise AssertionError("the job never started")


def _running_load(
    services, folder: Path, sock_dir: Path, stored, clients: Clients, ticket_timeout_s: float
) -> tuple[ServiceProcess, StorageClient, int]:
    """A load of the whole `stored` chain into the pool's second half, running now on a
    service with one worker (the client gives it up after `ticket_timeout_s`)."""
    pool, hashes = stored
    svc, addr = _slow_service(services, folder, sock_dir)
    client = clients(addr, pool, ticket_timeout_s=ticket_timeout_s, ready_s=30)
    ticket = client.submit_load(hashes, list(range(MANY, 2 * MANY)))
    _wait_running(client)
    return svc, client, ticket


def test_a_ticket_given_up_while_its_job_runs_is_unsettled_until_the_late_reply(
    stored_folder: tuple[Path, list[bytes]], sock_dir: Path, stored, services, clients: Clients
) -> None:
    pool, _ = stored
    svc, client, ticket = _running_load(services, stored_folder[0], sock_dir, stored, clients, 1.0)
    svc.signal(signal.SIGSTOP)  # frozen in the middle of the job
    try:
        [done] = client.wait([ticket], 10)
        assert (done.error, done.settled, done.pages_ok) == ("timed out", False, 0)
        assert client.quarantined == 1
        # Frozen: nothing can settle it yet.
        assert [e for e in _events(client, 0.5) if e.ticket == ticket] == []
    finally:
        svc.signal(signal.SIGCONT)
    [settled] = client.wait_settled([ticket], 30)
    assert settled.reason in ("late reply", "cancel acknowledged")
    assert client.quarantined == 0
    pool.array[MANY:] = MARK  # reused only now
    wait_idle(client)
    assert [e for e in _events(client, 0.3) if e.ticket == ticket] == []  # exactly one
    assert (pool.array[MANY:] == MARK).all()
    assert client.counters["quarantined"] == 1 and client.counters["timed_out"] == 1


def test_cancel_stops_a_running_job_at_its_next_page(
    stored_folder: tuple[Path, list[bytes]], sock_dir: Path, stored, services, clients: Clients
) -> None:
    _, client, ticket = _running_load(services, stored_folder[0], sock_dir, stored, clients, 60.0)
    client.cancel(ticket)
    [done] = [e for e in client.poll() if e.ticket == ticket]  # at once, without waiting
    assert isinstance(done, Completion)
    assert (done.error, done.settled) == ("cancelled", False)
    [settled] = client.wait_settled([ticket], 30)
    assert settled.reason in ("late reply", "cancel acknowledged")
    stats = client.stats()
    assert stats is not None and stats.disk is not None
    assert stats.disk.extra.get("late_skipped", 0) > 0  # the rest of its pages never started
    assert (
        stats.service.get("cancelled_running", 0) + stats.service.get("cancelled_waiting", 0) == 1
    )
    client.cancel(ticket)  # already completed: nothing more comes
    assert _events(client, 0.2) == []


def test_a_killed_service_settles_every_quarantined_ticket(
    stored_folder: tuple[Path, list[bytes]], sock_dir: Path, stored, services, clients: Clients
) -> None:
    pool, hashes = stored
    svc, addr = _slow_service(services, stored_folder[0], sock_dir)
    client = clients(addr, pool, ticket_timeout_s=1.0)
    patient = clients(addr, pool, ticket_timeout_s=60.0)
    assert client.wait_ready(30) and patient.wait_ready(30)
    svc.signal(signal.SIGSTOP)
    given_up = [
        client.submit_load(hashes[:100], list(range(MANY, MANY + 100))),
        client.submit_store(refs(new_hashes(10), range(10))),
    ]
    done = client.wait(given_up, 10)
    assert sorted(c.ticket for c in done) == given_up and not any(c.settled for c in done)
    still_open = patient.submit_load(hashes[:10], list(range(MANY + 200, MANY + 210)))
    svc.kill()  # SIGKILL of the frozen process, reaped
    [c] = patient.wait([still_open], 10)
    assert c.error == "cache service disconnected" and c.settled  # its service is gone
    settled = client.wait_settled(given_up, 10)
    assert sorted(s.ticket for s in settled) == given_up
    assert {s.reason for s in settled} == {"service exited"}
    assert client.quarantined == 0 and _events(client, 0.2) == []


def test_in_thread_close_settles_what_was_given_up(
    stored_folder: tuple[Path, list[bytes]], sock_dir: Path, stored
) -> None:
    pool, hashes = stored
    service = ServiceConfig(stored_folder[0], f"ipc://{sock_dir}/t.sock", workers=1, io_threads=1)
    client = client_in_thread(service, ClientConfig("", NAMESPACE, pool.segment.name, SMALL))
    try:
        assert client.wait_ready(10)
        ticket = client.submit_load(hashes, list(range(MANY, 2 * MANY)))
        client.cancel(ticket)
        [done] = client.poll()
        assert isinstance(done, Completion) and not done.settled
    finally:
        client.close()
    events = client.poll()  # after close: what is left, without touching sockets
    events += client.poll()
    assert [(type(e), e.ticket) for e in events] in ([], [(Settled, ticket)])
    assert client.quarantined == 0


def test_a_ticket_cancelled_before_it_arrives_is_refused(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services
) -> None:
    """The wire contract, on a raw socket: a Cancel for a ticket the service has not seen
    is settled at once, and that ticket, arriving later, never touches its slots."""
    pool = make_pool(8, fill=4, seed=3)
    hashes = new_hashes(4)
    disk = DiskBackend(DiskConfig(tmp_path / "kv", NAMESPACE, SMALL, 1 << 30))
    assert disk.put(refs(hashes, range(4)), pool.array) == 4
    disk.close()
    addr = f"ipc://{sock_dir}/raw.sock"
    svc = services(tmp_path / "kv", addr)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    try:

        def ask(msg: object) -> object:
            sock.send(encode(msg))
            assert sock.poll(20_000)
            return decode(sock.recv())

        reg = ask(Register(1, NAMESPACE, pool.segment.name, SMALL))
        assert isinstance(reg, RegisterReply) and reg.error is None and reg.pid == svc.pid
        assert ask(Cancel(2, 7)) == CancelReply(2, 7, True)
        pool.array[4:8] = MARK
        reply = ask(Load(7, tuple(hashes), (4, 5, 6, 7), time.monotonic_ns() + 10**10))
        assert isinstance(reply, LoadReply) and (reply.pages_ok, reply.error) == (0, "cancelled")
        assert (pool.array[4:8] == MARK).all()
        reply = ask(Load(8, tuple(hashes), (4, 5, 6, 7), time.monotonic_ns() + 10**10))
        assert isinstance(reply, LoadReply) and reply.pages_ok == 4
        assert np.array_equal(pool.array[4:8], pool.array[0:4])
        expired = ask(Load(9, tuple(hashes), (4, 5, 6, 7), time.monotonic_ns() - 1))
        assert isinstance(expired, LoadReply) and expired.pages_ok == 0
    finally:
        sock.close(linger=0)
        ctx.term()
