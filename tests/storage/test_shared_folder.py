"""Two live cache service processes on one disk folder: each serves the other's new pages
(adopted from the folder on an index miss), a page one evicted is a miss for the other (and
leaves its index), and together they keep the folder under its one capacity."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from pools import NAMESPACE, Pool, new_hashes, refs
from storage_clients import Clients

from asynchicache.settings.config import GIB
from asynchicache.storage.base import PageLayout, TicketKind
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.disk.disk_admin import verify_folder
from asynchicache.storage.disk.disk_backend import DiskConfig

LAYOUT = PageLayout("float32", (2, 2, 16, 2, 16))  # 8 KiB pages
FILE = DiskConfig(Path("/unused"), NAMESPACE, LAYOUT, 1).page_file_bytes


@pytest.fixture
def clients(clients: Clients) -> Clients:
    """Clients that are connected when returned."""
    return functools.partial(clients, ready_s=30, ticket_timeout_s=60)


def two_services(tmp_path: Path, sock_dir: Path, services, pages: int) -> tuple[str, str]:
    """Two service processes on one folder sized for `pages` page files; their addresses."""
    gib = str(pages * FILE / GIB)
    addrs = (f"ipc://{sock_dir}/a.sock", f"ipc://{sock_dir}/b.sock")
    for a in addrs:
        services(tmp_path / "kv", a, "--disk-cache-gb", gib)
    return addrs


def store(client: StorageClient, hashes: list[bytes], slots: list[int] | range) -> int:
    ticket = client.submit_store(refs(hashes, slots))
    [done] = client.wait([ticket], 60)
    return done.pages_ok


def load(client: StorageClient, hashes: list[bytes], slots: list[int]) -> int:
    ticket = client.submit_load(hashes, slots)
    [done] = client.wait([ticket], 60)
    assert done.kind is TicketKind.LOAD
    return done.pages_ok


def folder_bytes(root: Path) -> int:
    """What the page files of the folder take (every namespace)."""
    return sum(p.stat().st_size for p in root.rglob("*.kv"))


def test_each_service_serves_the_pages_the_other_stored_after_it_started(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    a_addr, b_addr = two_services(tmp_path, sock_dir, services, 1000)
    pool_a, pool_b = make_pool(64, LAYOUT), make_pool(64, LAYOUT)
    pool_a.fill(range(32), seed=1)
    a, b = clients(a_addr, pool_a), clients(b_addr, pool_b)
    hashes = new_hashes(32)
    assert b.exists(hashes) == 0  # B started first and knows nothing
    assert store(a, hashes, range(32)) == 32
    assert b.exists(hashes) == 32  # an index miss looked at the folder
    assert load(b, hashes, list(range(32))) == 32
    assert np.array_equal(pool_b.array[:32], pool_a.array[:32])
    assert b.stats().disk.extra["adopted"] == 32  # type: ignore[union-attr]
    more = new_hashes(8)  # and the other way round, straight to a load
    pool_b.fill(range(32, 40), seed=2)
    assert store(b, more, range(32, 40)) == 8
    assert load(a, hashes + more, list(range(24, 64))) == 40
    assert np.array_equal(pool_a.array[56:64], pool_b.array[32:40])


def test_a_page_the_other_service_evicted_is_a_miss_and_leaves_the_index(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    a_addr, b_addr = two_services(tmp_path, sock_dir, services, 40)
    pool_a, pool_b = make_pool(64, LAYOUT), make_pool(64, LAYOUT)
    pool_a.fill(range(64))
    a, b = clients(a_addr, pool_a), clients(b_addr, pool_b)
    old = new_hashes(10)
    assert store(a, old, range(10)) == 10
    assert load(b, old, list(range(10))) == 10  # B indexes them too
    for _ in range(3):  # A fills the folder over with new pages: its LRU (old) goes
        assert store(a, new_hashes(20), range(20, 40)) == 20
    assert not [h for h in old if list((tmp_path / "kv").rglob(h.hex() + ".kv"))]
    assert b.exists(old) == 10  # B's index still names them ...
    assert load(b, old, list(range(10))) == 0  # ... a load finds them gone: a miss
    assert b.exists(old) == 0  # and its index let them go
    assert b.stats().disk.extra["vanished"] >= 1  # type: ignore[union-attr]


def test_two_services_writing_one_folder_keep_it_under_its_size(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    capacity_pages = 60
    addrs = two_services(tmp_path, sock_dir, services, capacity_pages)
    pools = [make_pool(64, LAYOUT), make_pool(64, LAYOUT)]
    for p in pools:
        p.fill(range(64))
    both = [clients(addr, pool) for addr, pool in zip(addrs, pools, strict=True)]
    stored = [0, 0]

    def writer(k: int) -> None:
        for _ in range(12):  # 12 x 16 pages each: six times the folder's size in all
            stored[k] += store(both[k], new_hashes(16), range(16 * (k + 1), 16 * (k + 2)))

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    root = tmp_path / "kv"
    assert stored[0] > 0 and stored[1] > 0
    assert folder_bytes(root) <= capacity_pages * FILE  # one limit for the whole folder
    assert folder_bytes(root) >= (capacity_pages - 16) * FILE  # and it is used
    assert verify_folder(root).bad == 0
