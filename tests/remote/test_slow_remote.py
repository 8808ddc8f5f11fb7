"""Issue 39, finding 4: a slow Redis (each reply 0.4 s late, under the breaker's timeouts)
must not freeze the cache service. It froze the service's loop (`Exists` asked Redis on
it), so a disk load waited behind every lookup; and a store whose upload found the
staging full uploaded inline, so disk work waited behind L4 writes. Now the loop never
talks to Redis, stores never wait on it, and at most half the workers read from it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pools import NAMESPACE, SMALL, Pool, new_hashes, refs
from redis_server import RedisServer
from service_process import ServiceProcess
from slow_proxy import SlowProxy

from asynchicache.storage.client.storage_client import ClientConfig, StorageClient
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.remote.remote_backend import RedisBackend, RedisConfig
from asynchicache.storage.service.tiered import TieredBackend, TieredConfig

DELAY_S = 0.4  # RedisConfig.control_timeout_s is 0.5: never an outage


@pytest.fixture
def slow_redis(redis_server: RedisServer) -> Iterator[SlowProxy]:
    proxy = SlowProxy(redis_server.port, DELAY_S)
    yield proxy
    proxy.close()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="acsl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _client(address: str, pool: Pool, **kw: object) -> StorageClient:
    cfg = ClientConfig(address, NAMESPACE, pool.segment.name, pool.layout, **kw)  # type: ignore[arg-type]
    client = StorageClient(cfg)
    assert client.wait_ready(30.0)
    return client


def _remote_up(client: StorageClient, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = client.stats(5.0)
        if stats is not None and stats.remote is not None and stats.remote.extra["available"]:
            return
        time.sleep(0.1)
    raise AssertionError("the remote tier never came up behind the slow proxy")


def test_lookups_on_a_slow_redis_do_not_hold_up_disk_loads(
    slow_redis: SlowProxy, make_pool: Callable[..., Pool], sock_dir: Path, tmp_path: Path
) -> None:
    address = f"ipc://{sock_dir}/s.sock"
    service = ServiceProcess(tmp_path / "kv", address, "--remote-url", slow_redis.url).start()
    clients: list[StorageClient] = []
    try:
        pool = make_pool(16, fill=8)
        main = _client(address, pool)
        clients.append(main)
        _remote_up(main)
        on_disk = new_hashes(4)
        [done] = main.wait([main.submit_store(refs(on_disk, range(4)))], 30.0)
        assert done.pages_ok == 4
        # Eight engines ask, at once, for chains only Redis could hold.
        askers = [_client(address, pool, exists_timeout_s=30.0) for _ in range(8)]
        clients += askers
        answers: list[tuple[int, int]] = []
        threads = [
            threading.Thread(target=lambda a=a: answers.append(a.exists_by_tier(new_hashes(2))))
            for a in askers
        ]
        for t in threads:
            t.start()
        time.sleep(0.2)  # their lookups are in the service now
        t0 = time.monotonic()
        [done] = main.wait([main.submit_load(on_disk, list(range(8, 12)))], 30.0)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30.0)
        stats = main.stats(5.0)
    finally:
        for c in clients:
            c.close()
        service.stop()
    assert done.pages_ok == 4
    assert answers == [(0, 0)] * 8  # none is in Redis (asked, or answered from the disk)
    # One lookup thread, 0.4 s a question: the later ones waited past LOOKUP_STALE_S and
    # answered from the disk without asking.
    assert stats is not None and stats.service.get("remote_lookups_shed", 0) >= 1, stats
    # Behind eight lookups of 0.4 s each on the loop this took over 3 s.
    assert took < 1.5, f"a disk load took {took:.2f} s behind lookups on a slow Redis"


def test_stores_never_wait_on_a_slow_redis(
    slow_redis: SlowProxy, make_pool: Callable[..., Pool], tmp_path: Path
) -> None:
    """Uploads beyond the staging budget are skipped and counted, never made inline."""
    disk = DiskBackend(DiskConfig(tmp_path / "kv", NAMESPACE, SMALL, 1 << 30))
    cfg = RedisConfig(slow_redis.url, NAMESPACE, SMALL, retry_initial_s=0.1)
    remote = RedisBackend(cfg)
    assert remote.wait_available(30.0)
    tiered = TieredBackend(disk, remote, TieredConfig(staging_bytes=SMALL.page_bytes * 2))
    try:
        pool = make_pool(16, fill=8)
        t0 = time.monotonic()
        for k in range(4):  # the first fills the staging budget; the others find it full
            assert tiered.put(refs(new_hashes(2), [2 * k, 2 * k + 1]), pool.array) == 2
        took = time.monotonic() - t0
        shed = tiered.stats().extra["uploads_shed"]
    finally:
        tiered.close()
    assert shed >= 2
    # Inline, each of those uploads waited for an EXISTS and a SET round trip (0.8 s).
    assert took < 2 * DELAY_S, f"four disk stores took {took:.2f} s"


def test_loads_reading_redis_leave_workers_for_the_disk(
    slow_redis: SlowProxy, make_pool: Callable[..., Pool], tmp_path: Path
) -> None:
    """At most `remote_jobs` loads read L4 at once; another serves the disk's part."""
    writer = RedisBackend(RedisConfig(slow_redis.url, NAMESPACE, SMALL, retry_initial_s=0.1))
    disk = DiskBackend(DiskConfig(tmp_path / "kv", NAMESPACE, SMALL, 1 << 30))
    remote = RedisBackend(RedisConfig(slow_redis.url, NAMESPACE, SMALL, retry_initial_s=0.1))
    tiered = TieredBackend(disk, remote, TieredConfig(remote_jobs=1, promote_to_disk=False))
    try:
        assert writer.wait_available(30.0) and remote.wait_available(30.0)
        pool = make_pool(16, fill=8)
        only_remote = new_hashes(2)
        assert writer.put(refs(only_remote, [0, 1]), pool.array) == 2
        slow = threading.Thread(target=tiered.load, args=(only_remote, [8, 9], pool.array))
        slow.start()
        time.sleep(0.1)  # it holds the one L4 reader now
        read = tiered.load(only_remote, [10, 11], pool.array)
        slow.join(30.0)
        shed = tiered.stats().extra["remote_reads_shed"]
    finally:
        tiered.close()
        writer.close()
    assert (read.pages_ok, shed) == (0, 1)
