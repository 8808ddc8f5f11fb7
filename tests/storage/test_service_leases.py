"""Leases on a real cache service process (storage.service.leases): a service started
`--leased-by` its starter runs while any lease is held, and stops once the last one
ends (released, its holder killed, or not renewed), after its writes in flight.

Lease holders are real processes (`sleep`), so a test can kill one as a crash would.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pools import DEFAULT, Pool, new_hashes, refs
from service_process import ServiceProcess
from storage_clients import Clients

from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.messages import ServiceSettings
from asynchicache.storage.service.service_cli import config_from_args

Holders = Callable[[], subprocess.Popen[bytes]]


@pytest.fixture
def holders() -> Iterator[Holders]:
    """Processes that only live (a vLLM engine core's stand-in); killed after the test."""
    made: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        made.append(subprocess.Popen(["sleep", "600"]))
        return made[-1]

    yield start
    for proc in made:
        proc.kill()
        proc.wait(10)


def _settings(disk: Path, address: str, *extra: str) -> ServiceSettings:
    """What a service started with these flags runs with (the connector's way to ask)."""
    argv = ["--disk-cache-dir", str(disk), "--socket", address, *extra]
    return config_from_args(argv).settings


def _leased_service(services, disk: Path, address: str, starter: int) -> ServiceProcess:
    return services(disk, address, "--leased-by", str(starter))


def _exits(svc: ServiceProcess, timeout_s: float = 10.0) -> int | None:
    assert svc.proc is not None
    try:
        return svc.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _runs_for(svc: ServiceProcess, seconds: float) -> bool:
    assert svc.proc is not None
    time.sleep(seconds)
    return svc.proc.poll() is None


def _lease(client: StorageClient, holder: int, settings: ServiceSettings, ttl_s: float = 30.0):
    reply = client.lease(holder, settings, ttl_s, timeout_s=5.0)
    assert reply is not None, "the service did not answer the lease"
    return reply


def test_the_service_lives_while_any_holder_lives_and_exits_after_the_last(
    tmp_path: Path, sock_dir: Path, make_pool, services, clients: Clients, holders: Holders
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    starter, second = holders(), holders()
    svc = _leased_service(services, tmp_path / "kv", addr, starter.pid)
    want = _settings(tmp_path / "kv", addr)
    a = clients(addr, make_pool(4), ready_s=20)
    b = clients(addr, make_pool(4), ready_s=20)
    assert _lease(a, starter.pid, want).granted
    reply = _lease(b, second.pid, want)
    assert (reply.granted, reply.holders, reply.pid) == (True, 2, svc.pid)

    starter.kill()  # the instance that started it is gone (SIGKILL: no release)
    starter.wait(10)
    assert _runs_for(svc, 1.5), "the service stopped with its starter"
    assert _lease(b, second.pid, want).holders == 1  # a heartbeat: the starter's lease ended

    second.kill()
    second.wait(10)
    assert _exits(svc) == 0  # a clean exit once the last holder is gone


def test_a_release_ends_the_lease_and_the_stores_in_flight_finish(
    tmp_path: Path, sock_dir: Path, make_pool, services, clients: Clients, holders: Holders
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    holder = holders()
    svc = _leased_service(services, tmp_path / "kv", addr, holder.pid)
    pool: Pool = make_pool(64, DEFAULT, fill=64)  # 47 MB to write: longer than a sweep
    client = clients(addr, pool, ready_s=20)
    assert _lease(client, holder.pid, _settings(tmp_path / "kv", addr)).granted
    hashes = new_hashes(64)
    for part in range(0, 64, 4):  # more stores than workers: some wait in the queue
        client.submit_store(refs(hashes[part : part + 4], range(part, part + 4)))
    released = client.release(timeout_s=5.0)  # at once: the stores are still being written
    assert released is not None and (released.granted, released.holders) == (False, 0)
    assert _exits(svc, 30) == 0
    services(tmp_path / "kv", addr)  # a new service over the folder finds every page
    assert client.wait_ready(20)
    assert client.exists(hashes) == 64


def test_a_lease_not_renewed_ends(
    tmp_path: Path, sock_dir: Path, make_pool, services, clients: Clients, holders: Holders
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    holder = holders()
    svc = _leased_service(services, tmp_path / "kv", addr, holder.pid)
    client = clients(addr, make_pool(4), ready_s=20)
    assert _lease(client, holder.pid, _settings(tmp_path / "kv", addr), ttl_s=1.0).granted
    assert _exits(svc, 10) == 0  # the holder lives, but hung: no heartbeat for 1 s


def test_the_starter_holds_the_first_lease_until_it_dies(
    tmp_path: Path, sock_dir: Path, services, holders: Holders
) -> None:
    starter = holders()
    svc = _leased_service(services, tmp_path / "kv", f"ipc://{sock_dir}/svc.sock", starter.pid)
    assert _runs_for(svc, 1.5)  # nobody leased yet: the starter's first lease holds it
    starter.kill()
    starter.wait(10)
    assert _exits(svc) == 0


@pytest.mark.parametrize(
    ("flags", "conflicts"),
    [
        (("--disk-cache-gb", "3"), ("disk_cache_bytes",)),
        (("--remote-url", "redis://127.0.0.1:1/0"), ("remote_url",)),
        (
            ("--remote-url", "redis://127.0.0.1:1/0", "--remote-ttl", "60"),
            ("remote_url", "remote_ttl"),
        ),
        (("--no-direct-io", "--disk-sync", "none"), ()),  # how it writes is not compared
    ],
)
def test_other_settings_are_refused_naming_them(
    tmp_path: Path,
    sock_dir: Path,
    make_pool,
    services,
    clients: Clients,
    holders: Holders,
    flags: tuple[str, ...],
    conflicts: tuple[str, ...],
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    holder = holders()
    svc = _leased_service(services, tmp_path / "kv", addr, holder.pid)
    client = clients(addr, make_pool(4), ready_s=20)
    ours = _settings(tmp_path / "kv", addr)
    reply = _lease(client, holder.pid, _settings(tmp_path / "kv", addr, *flags))
    assert (reply.granted, reply.conflicts, reply.settings) == (not conflicts, conflicts, ours)
    other_folder = dataclasses.replace(ours, disk_cache_dir=str(tmp_path / "other"))
    assert _lease(client, holder.pid, other_folder).conflicts == ("disk_cache_dir",)
    assert _lease(client, holder.pid, ours).granted  # the same settings are fine
    stats = client.stats(5.0)
    assert stats is not None and stats.service["leases_refused"] == 1 + bool(conflicts)
    assert svc.proc is not None and svc.proc.poll() is None


def test_a_service_without_leased_by_grants_leases_and_keeps_running(
    tmp_path: Path, sock_dir: Path, make_pool, services, clients: Clients, holders: Holders
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    svc = services(tmp_path / "kv", addr)  # `asynchicache serve`'s own kind of service
    holder = holders()
    client = clients(addr, make_pool(4), ready_s=20)
    assert _lease(client, holder.pid, _settings(tmp_path / "kv", addr)).granted
    holder.kill()
    holder.wait(10)
    assert _runs_for(svc, 1.5)
