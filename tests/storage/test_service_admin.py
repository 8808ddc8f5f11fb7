"""Clear and pins through real cache service processes and their typed messages."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from pools import NAMESPACE, SMALL, Pool, chain
from storage_clients import Clients

from asynchicache.common.keys import Namespace
from asynchicache.settings.config import GIB
from asynchicache.storage.admin_messages import ClearedPages
from asynchicache.storage.base import PageRef
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.disk.disk_backend import DiskConfig

FILE = DiskConfig(Path("/unused"), NAMESPACE, SMALL, 1).page_file_bytes
PAGE = SMALL.shape[2]
NS = Namespace("m", "float32", PAGE)


@pytest.fixture
def clients(clients: Clients) -> Clients:
    """Clients that are connected when returned."""
    return functools.partial(clients, ready_s=30)


def store(client: StorageClient, pages: list[PageRef]) -> None:
    ticket = client.submit_store(pages)
    [done] = client.wait([ticket], 30)
    assert done.pages_ok == len(pages), done


def hashes(pages: list[PageRef]) -> list[bytes]:
    return [p.page_hash for p in pages]


def test_pins_through_the_service_survive_a_restart_and_bind_the_other_service(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    gib = str(20 * FILE / GIB)
    a_addr, b_addr = f"ipc://{sock_dir}/a.sock", f"ipc://{sock_dir}/b.sock"
    a_svc = services(tmp_path / "kv", a_addr, "--disk-cache-gb", gib)
    services(tmp_path / "kv", b_addr, "--disk-cache-gb", gib)
    pool_a, pool_b = make_pool(32), make_pool(32)
    pool_a.fill(range(32))
    pool_b.fill(range(32))
    a, b = clients(a_addr, pool_a), clients(b_addr, pool_b)
    system = chain(NS.digest(), 0, 4)
    store(a, system)
    reply = a.pin(hashes(system), NS.digest(), "", ttl_s=3600)
    assert reply is not None and reply.code is None and reply.pages_present == 4
    assert reply.pin is not None and reply.pinned_bytes == 4 * FILE
    assert reply.limit_bytes == int(0.5 * 20 * FILE)
    assert a_svc.stop() == 0
    a_svc = services(tmp_path / "kv", a_addr, "--disk-cache-gb", gib)
    a = clients(a_addr, pool_a)
    listed = a.pins()
    assert listed is not None and [p.pin_id for p in listed.pins] == [reply.pin.pin_id]
    assert listed.pinned_pages == 4
    for k in range(1, 6):  # B churns the folder over several times
        store(b, chain(NS.digest(), 1000 * k, 16))
    assert a.exists(hashes(system)) == 4 and b.exists(hashes(system)) == 4
    too_big = b.pin(hashes(chain(NS.digest(), 9000, 8)), NS.digest())
    assert too_big is not None and too_big.code == "over_limit" and too_big.pin is None
    assert "--max-pinned-fraction" in (too_big.error or "")
    assert b.unpin([reply.pin.pin_id]) == 1
    assert a.pins().pins == ()  # type: ignore[union-attr]


def test_clear_one_salt_keeps_the_rest_and_pinned_pages_unless_asked(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    services(tmp_path / "kv", addr)
    pool = make_pool(32, fill=32)
    client = clients(addr, pool)
    salt = NS.with_salt("tenant-a").digest()
    tenant, kept_pinned, others = (
        chain(salt, 0, 6),
        chain(salt, 500, 3, 6),
        chain(NS.digest(), 0, 6, 9),
    )
    for run in (tenant, kept_pinned, others):
        store(client, run)
    pin = client.pin(hashes(kept_pinned), salt, "tenant-a")
    assert pin is not None and pin.pin is not None and pin.pin.owner == "tenant-a"
    done = client.clear(("disk",), root=salt)
    assert done is not None and done.tiers == (ClearedPages("disk", 6, 3),) and done.removed == 6
    assert client.exists(hashes(tenant)) == 0 and client.exists(hashes(kept_pinned)) == 3
    assert client.exists(hashes(others)) == 6
    remote = client.clear(("remote",))
    assert remote is not None and remote.tiers[0].error == "no remote tier configured"
    forced = client.clear(("disk",), root=salt, include_pinned=True)
    assert forced is not None and forced.removed == 3 and client.pins().pins == ()  # type: ignore[union-attr]
    assert client.exists(hashes(others)) == 6


def test_a_salt_clear_finds_the_chains_another_service_stored(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    """B adopted A's pages by name (the first one's parent unknown to B): its salt clear reads
    what it lacks from the headers and removes the whole chain."""
    a_addr, b_addr = f"ipc://{sock_dir}/a.sock", f"ipc://{sock_dir}/b.sock"
    services(tmp_path / "kv", a_addr)
    services(tmp_path / "kv", b_addr)
    pool_a, pool_b = make_pool(16), make_pool(16)
    pool_a.fill(range(16))
    a, b = clients(a_addr, pool_a), clients(b_addr, pool_b)
    salt = NS.with_salt("tenant-a").digest()
    tenant, others = chain(salt, 0, 6), chain(NS.digest(), 0, 4, 6)
    store(a, tenant)
    store(a, others)
    assert b.exists(hashes(tenant)) == 6 and b.exists(hashes(others)) == 4  # adopted
    done = b.clear(("disk",), root=salt)
    assert done is not None and done.removed == 6
    assert a.exists(hashes(tenant)) == 6  # A's index still names them ...
    assert b.exists(hashes(tenant)) == 0 and b.exists(hashes(others)) == 4
    ticket = a.submit_load(hashes(tenant), list(range(6)))
    [loaded] = a.wait([ticket], 30)
    assert loaded.pages_ok == 0  # ... but they are gone: misses
