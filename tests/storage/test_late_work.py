"""Storage work that runs late never touches an L2 slot the engine may have reused.

Issue 11, defect 1. The cache service is a real process; SIGSTOP/SIGCONT make
its work late, as a frozen disk or an overloaded machine would. The test plays
the engine: it reuses a ticket's slots (writes other bytes into them) only
once the client says the service will not touch them any more, i.e. when the
ticket's `Completion` is settled, or later at its `Settled`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pools import NAMESPACE, SMALL, Pool, new_hashes, refs
from service_process import ServiceProcess
from storage_clients import Clients, wait_idle

from asynchicache.storage.base import Completion, Settled
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig

# Enough 1 KiB pages that one service thread needs well over the ticket timeout for them.
MANY = 20_000
REUSED = 0x5A  # what the engine writes into a slot it reused


def _slow_service(services, disk_dir: Path, sock_dir: Path) -> tuple[ServiceProcess, str]:
    """One worker, one I/O thread: a big job takes long, page after page."""
    addr = f"ipc://{sock_dir}/svc.sock"
    return services(disk_dir, addr, "--workers", "1", "--io-threads", "1"), addr


def _settle(client: StorageClient, done: Completion, timeout_s: float = 60.0) -> list[Settled]:
    """Wait until the service will touch `done`'s slots no more; the Settled events seen."""
    if done.settled:
        return []
    seen: list[Settled] = []
    deadline = time.monotonic() + timeout_s
    while not seen and time.monotonic() < deadline:
        seen += [e for e in client.poll() if isinstance(e, Settled) and e.ticket == done.ticket]
        time.sleep(0.005)
    assert seen, f"ticket {done.ticket} never settled"
    return seen


def _prefill(disk_dir: Path, pool: Pool, hashes: list[bytes]) -> None:
    disk = DiskBackend(DiskConfig(disk_dir, NAMESPACE, SMALL, 1 << 34))
    try:
        assert disk.put(refs(hashes, range(len(hashes))), pool.array) == len(hashes)
    finally:
        disk.close()


def test_a_store_queued_while_the_service_was_frozen_persists_only_its_own_bytes(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    """A store waits in the socket while the service is frozen; the client gives up; the
    engine reuses the slots; whatever the service persists later is the store's own bytes."""
    pool = make_pool(MANY, fill=MANY, seed=11)
    original = pool.array.copy()
    svc, addr = _slow_service(services, tmp_path / "kv", sock_dir)
    client = clients(addr, pool, ticket_timeout_s=1.0, ready_s=30)
    hashes = new_hashes(MANY)
    svc.signal(signal.SIGSTOP)
    try:
        ticket = client.submit_store(refs(hashes, range(MANY)))
        time.sleep(0.8)  # queued in ZeroMQ, most of the ticket's time gone
    finally:
        svc.signal(signal.SIGCONT)
    [done] = client.wait([ticket], 30)
    _settle(client, done)
    pool.array[:] = REUSED  # the engine reuses every slot of the store
    wait_idle(client)
    disk = DiskBackend(DiskConfig(tmp_path / "kv", NAMESPACE, SMALL, 1 << 34))
    check = make_pool(1)
    try:
        stored = [i for i, h in enumerate(hashes) if disk.path_of(h).exists()]
        wrong = [i for i in stored if _read(disk, hashes[i], check) != original[i].tobytes()]
    finally:
        disk.close()
    assert not wrong, f"{len(wrong)} of {len(stored)} persisted pages hold bytes of reused slots"


def _read(disk: DiskBackend, page_hash: bytes, check: Pool) -> bytes:
    return check.array[0].tobytes() if disk.get([page_hash], [0], check.array) == 1 else b""


def test_a_load_queued_while_the_service_was_frozen_never_writes_a_reused_slot(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    pool = make_pool(2 * MANY, fill=MANY, seed=12)
    hashes = new_hashes(MANY)
    _prefill(tmp_path / "kv", pool, hashes)
    svc, addr = _slow_service(services, tmp_path / "kv", sock_dir)
    client = clients(addr, pool, ticket_timeout_s=1.0, ready_s=30)
    slots = list(range(MANY, 2 * MANY))
    svc.signal(signal.SIGSTOP)
    try:
        ticket = client.submit_load(hashes, slots)
        time.sleep(0.8)
    finally:
        svc.signal(signal.SIGCONT)
    [done] = client.wait([ticket], 30)
    _settle(client, done)
    pool.array[MANY:] = REUSED  # the engine reuses the load's slots for other pages
    wait_idle(client)
    touched = int(np.count_nonzero((pool.array[MANY:] != REUSED).any(axis=1)))
    assert touched == 0, f"{touched} reused slots were overwritten by the late load"
