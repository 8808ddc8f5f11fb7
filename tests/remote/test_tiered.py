"""TieredBackend: disk (L3) then Redis (L4), uploads and promotions from private copies."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from pools import NAMESPACE, SMALL, Pool, new_hashes, refs
from redis_server import RedisServer

from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.remote.remote_backend import RedisBackend, RedisConfig
from asynchicache.storage.service.tiered import TieredBackend, TieredConfig

Tiers = Callable[..., TieredBackend]


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Tiers]:
    """TieredBackends, each with its own disk folder, sharing whatever Redis URL is given."""
    opened: list[TieredBackend] = []

    def make(url: str | None, name: str, wait: bool = True, **tiered: object) -> TieredBackend:
        disk = DiskBackend(DiskConfig(tmp_path / name, NAMESPACE, SMALL, 1 << 30))
        remote = None
        if url is not None:
            cfg = RedisConfig(url, NAMESPACE, SMALL, retry_initial_s=0.1, retry_max_s=0.4)
            remote = RedisBackend(cfg)
            if wait:
                assert remote.wait_available(10.0)
        opened.append(TieredBackend(disk, remote, TieredConfig(**tiered)))  # type: ignore[arg-type]
        return opened[-1]

    yield make
    for t in opened:
        t.close()


def _stored_by_a_read_by_b(
    redis_server: RedisServer, tiers: Tiers, pool: Pool
) -> tuple[list[bytes], TieredBackend]:
    """A chain of 8 pages (slots 0-7) stored by instance "a" on its disk and in Redis; and
    instance "b", which shares only Redis with it."""
    a = tiers(redis_server.url, "a")
    b = tiers(redis_server.url, "b")
    hashes = new_hashes(8)
    assert a.put(refs(hashes, range(8)), pool.array) == 8
    assert a.drain(10.0)
    assert a.remote is not None and a.remote.exists(hashes) == 8
    return hashes, b


def test_pages_only_in_redis_are_served_and_written_to_disk(
    redis_server: RedisServer, tiers: Tiers, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(24, fill=8)
    hashes, b = _stored_by_a_read_by_b(redis_server, tiers, pool)
    # B's disk is empty: the whole chain comes from Redis.
    assert b.disk.exists(hashes) == 0
    assert b.exists(hashes) == 8
    read = b.load(hashes, list(range(8, 16)), pool.array)
    assert (read.pages_ok, read.pages_from_remote) == (8, 8)
    assert np.array_equal(pool.array[8:16], pool.array[0:8])
    # ... and was written to B's disk on the way up, with the tokens of the headers.
    assert b.drain(10.0)
    assert b.disk.exists(hashes) == 8
    pool.array[8:16] = 0
    assert b.disk.get(hashes, list(range(8, 16)), pool.array) == 8
    assert np.array_equal(pool.array[8:16], pool.array[0:8])
    read = b.load(hashes, list(range(16, 24)), pool.array)
    assert (read.pages_ok, read.pages_from_remote) == (8, 0)
    assert b.stats().extra["pages_from_remote"] == 8


def test_disk_prefix_then_redis_rest(
    redis_server: RedisServer, tiers: Tiers, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    hashes, b = _stored_by_a_read_by_b(redis_server, tiers, pool)
    assert b.disk.put(refs(hashes[:3], range(3)), pool.array) == 3
    assert b.exists(hashes) == 8
    read = b.load(hashes, list(range(8, 16)), pool.array)
    assert (read.pages_ok, read.pages_from_remote) == (8, 5)
    assert np.array_equal(pool.array[8:16], pool.array[0:8])


def test_upload_uses_a_private_copy(
    redis_server: RedisServer, tiers: Tiers, make_pool: Callable[..., Pool]
) -> None:
    """The engine reuses a store's slots once it is answered; the upload must not see that."""
    pool = make_pool(16, fill=8)
    original = pool.array[:8].copy()
    a = tiers(redis_server.url, "a")
    hashes = new_hashes(8)
    assert a.put(refs(hashes, range(8)), pool.array) == 8
    pool.array[:8] = 0xAB  # the slots get new contents right after the reply
    assert a.drain(10.0)
    b = tiers(redis_server.url, "b")
    assert b.get(hashes, list(range(8, 16)), pool.array) == 8
    assert np.array_equal(pool.array[8:16], original)


def test_full_staging_skips_the_upload(
    redis_server: RedisServer, tiers: Tiers, make_pool: Callable[..., Pool]
) -> None:
    """A store never waits on L4 (issue 39, finding 4): past the staging budget its upload
    is skipped and counted; the disk has the pages."""
    pool = make_pool(16, fill=8)
    a = tiers(redis_server.url, "a", staging_bytes=SMALL.page_bytes)  # one page fits
    hashes = new_hashes(8)
    assert a.put(refs(hashes, range(8)), pool.array) == 8
    assert a.stats().extra["uploads_shed"] == 1
    assert a.disk.exists(hashes) == 8
    assert a.remote is not None and a.remote.exists(hashes) == 0


def test_admission_limits_promotion(
    redis_server: RedisServer, tiers: Tiers, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    a = tiers(redis_server.url, "a")
    hashes = new_hashes(8)
    assert a.put(refs(hashes, range(8)), pool.array) == 8
    assert a.drain(10.0)
    # 8 pages x 4 tokens = 32 tokens < 64: not admitted to B's disk.
    b = tiers(redis_server.url, "b", disk_admit_tokens=64, page_tokens=4)
    assert b.load(hashes, list(range(8, 16)), pool.array).pages_from_remote == 8
    assert b.drain(10.0) and b.disk.exists(hashes) == 0
    c = tiers(redis_server.url, "c", disk_admit_tokens=32, page_tokens=4)
    assert c.load(hashes, list(range(8, 16)), pool.array).pages_from_remote == 8
    assert c.drain(10.0) and c.disk.exists(hashes) == 8


def test_redis_down_serves_from_disk_without_waiting(
    redis_servers: Callable[..., RedisServer], tiers: Tiers, make_pool: Callable[..., Pool]
) -> None:
    server = redis_servers()
    pool = make_pool(16, fill=8)
    a = tiers(server.url, "a")
    hashes = new_hashes(8)
    assert a.put(refs(hashes[:4], range(4)), pool.array) == 4
    assert a.drain(10.0)
    server.kill()
    t0 = time.perf_counter()
    assert a.put(refs(hashes, range(8)), pool.array) == 8  # disk still takes every page
    assert a.drain(10.0)
    assert a.exists(hashes) == 8
    assert a.get(hashes, list(range(8, 16)), pool.array) == 8
    assert time.perf_counter() - t0 < 2.0
    assert a.remote is not None and not a.remote.available
    b = tiers(server.url, "b", wait=False)  # Redis down at start: disk-only answers
    assert b.exists(hashes) == 0
    assert b.load(hashes, list(range(8, 16)), pool.array).pages_ok == 0
    redis_servers(port=server.port)
    assert b.remote is not None and b.remote.wait_available(5.0)
    assert b.exists(hashes) == 0  # the restarted Redis is empty (no persistence)


def test_without_remote_it_is_the_disk(tiers: Tiers, make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(8, fill=4)
    t = tiers(None, "solo")
    hashes = new_hashes(4)
    assert t.put(refs(hashes, range(4)), pool.array) == 4
    assert t.exists(hashes) == 4
    assert t.load(hashes, [4, 5, 6, 7], pool.array).pages_from_remote == 0
    assert t.remote_stats() is None
    assert [c.removed for c in t.clear().values()] == [4]
