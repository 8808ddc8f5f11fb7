"""Two real cache service processes with their own disks, sharing one redis-server."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from pools import NAMESPACE, Pool, new_hashes, refs
from redis_server import RedisServer
from service_process import ServiceProcess

from asynchicache.storage.base import BackendStats, Completion
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient
from asynchicache.storage.messages import LoadReply, StatsReply, decode, encode
from asynchicache.storage.service.tiered import RemoteTierConfig


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="acr-"))  # short: ipc paths are limited to ~107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _client(address: str, pool: Pool) -> StorageClient:
    client = StorageClient(ClientConfig(address, NAMESPACE, pool.segment.name, pool.layout))
    assert client.wait_ready(30.0)
    return client


def _remote_ready(client: StorageClient, timeout_s: float = 10.0) -> StatsReply:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats is not None and stats.remote is not None and stats.remote.extra["available"]:
            return stats
        time.sleep(0.05)
    raise AssertionError("the service's remote tier did not come up")


def _one(client: StorageClient, ticket: int) -> Completion:
    [done] = client.wait([ticket], 30.0)
    return done


def test_second_service_loads_from_redis(
    redis_server: RedisServer,
    make_pool: Callable[..., Pool],
    sock_dir: Path,
    tmp_path: Path,
) -> None:
    a_addr, b_addr = f"ipc://{sock_dir}/a.sock", f"ipc://{sock_dir}/b.sock"
    services = [
        ServiceProcess(tmp_path / "disk-a", a_addr, "--remote-url", redis_server.url).start(),
        ServiceProcess(tmp_path / "disk-b", b_addr, "--remote-url", redis_server.url).start(),
    ]
    pool_a, pool_b = make_pool(16), make_pool(16)
    clients: list[StorageClient] = []
    try:
        a, b = _client(a_addr, pool_a), _client(b_addr, pool_b)
        clients += [a, b]
        _remote_ready(a)
        _remote_ready(b)
        pool_a.fill(range(8), seed=7)
        hashes = new_hashes(8)
        done = _one(a, a.submit_store(refs(hashes, range(8))))
        assert (done.pages_ok, done.error) == (8, None)
        deadline = time.monotonic() + 10
        while b.exists(hashes) < 8 and time.monotonic() < deadline:  # the upload is async
            time.sleep(0.05)
        assert b.exists(hashes) == 8
        done = _one(b, b.submit_load(hashes, list(range(8, 16))))
        assert (done.pages_ok, done.pages_from_remote, done.error) == (8, 8, None)
        assert np.array_equal(pool_b.array[8:16], pool_a.array[0:8])
        # B wrote them to its own disk on the way up: the next load is all disk.
        deadline = time.monotonic() + 10
        while True:
            stats = b.stats()
            assert stats is not None and stats.disk is not None
            if stats.disk.pages == 8 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stats.disk.pages == 8 and stats.remote is not None
        assert stats.remote.pages_read == 8
        done = _one(b, b.submit_load(hashes, list(range(8))))
        assert (done.pages_ok, done.pages_from_remote) == (8, 0)
    finally:
        for c in clients:
            c.close()
        codes = [s.stop() for s in services]
    assert codes == [0, 0]


def test_service_survives_redis_restart(
    redis_servers: Callable[..., RedisServer],
    make_pool: Callable[..., Pool],
    sock_dir: Path,
    tmp_path: Path,
) -> None:
    server = redis_servers()
    addr = f"ipc://{sock_dir}/s.sock"
    service = ServiceProcess(tmp_path / "disk", addr, "--remote-url", server.url).start()
    pool = make_pool(16)
    client = None
    try:
        client = _client(addr, pool)
        _remote_ready(client)
        pool.fill(range(8))
        hashes = new_hashes(8)
        server.kill()
        # Stores and loads keep working from disk; nothing fails, nothing waits long.
        t0 = time.monotonic()
        assert _one(client, client.submit_store(refs(hashes, range(8)))).pages_ok == 8
        done = _one(client, client.submit_load(hashes, list(range(8, 16))))
        assert (done.pages_ok, done.pages_from_remote, done.error) == (8, 0, None)
        assert client.exists(hashes) == 8
        assert time.monotonic() - t0 < 3.0
        redis_servers(port=server.port)
        stats = _remote_ready(client)
        assert stats.remote is not None and stats.remote.extra["breaker_trips"] >= 1
        more = new_hashes(4)
        assert _one(client, client.submit_store(refs(more, range(4)))).pages_ok == 4
        deadline = time.monotonic() + 10
        while server.cli("dbsize") != "4" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.cli("dbsize") == "4"
    finally:
        if client is not None:
            client.close()
        assert service.stop() == 0


def test_new_message_fields_round_trip() -> None:
    reply = LoadReply(7, 5, 8, "3 of 8 pages missed", pages_from_remote=4)
    assert decode(encode(reply)) == reply
    old_style = encode(LoadReply(7, 5, 8))
    assert decode(old_style).pages_from_remote == 0
    stats = StatsReply(1, BackendStats(pages=2), {"x": 1.0}, BackendStats(hits=3))
    assert decode(encode(stats)) == stats
    with pytest.raises(ValueError, match="remote-url"):
        RemoteTierConfig("memcached://h")
