"""A remote read that arrives late never lands in an L2 slot (issue 11, defect 1).

The pages live only in a real redis-server, which is frozen (SIGSTOP) while
the cache service reads them and thawed after the client gave up, but before
the 2 s socket timeout: its replies then reach the service late. The test
plays the engine and reuses the load's slots once the ticket is settled.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from pools import NAMESPACE, SMALL, Pool, new_hashes, refs
from redis_server import RedisServer
from remote_helpers import Backends
from service_process import ServiceProcess
from storage_clients import wait_idle

from asynchicache.storage.base import Settled
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient

MARK = 0x5A


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="acl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _remote_up(client: StorageClient) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats is not None and stats.remote is not None and stats.remote.extra["available"]:
            return
        time.sleep(0.05)
    raise AssertionError("the service's remote tier did not come up")


def test_a_late_redis_reply_never_lands_in_a_reused_slot(
    redis_server: RedisServer,
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
    tmp_path: Path,
    sock_dir: Path,
) -> None:
    pool = make_pool(16, fill=8, seed=8)
    hashes = new_hashes(8)
    assert remote_backends(redis_server.url).put(refs(hashes, range(8)), pool.array) == 8
    addr = f"ipc://{sock_dir}/svc.sock"
    service = ServiceProcess(tmp_path / "kv", addr, "--remote-url", redis_server.url).start()
    client = StorageClient(
        ClientConfig(addr, NAMESPACE, pool.segment.name, SMALL, ticket_timeout_s=1.0)
    )
    try:
        assert client.wait_ready(30)
        _remote_up(client)
        redis_server.pause()
        try:
            t0 = time.monotonic()
            ticket = client.submit_load(hashes, list(range(8, 16)))
            [done] = client.wait([ticket], 10)
            if not done.settled:
                settled = client.wait_settled([ticket], 10)
                assert [type(s) for s in settled] == [Settled]
            pool.array[8:16] = MARK  # the engine reuses the slots
            time.sleep(max(0.0, t0 + 1.4 - time.monotonic()))  # within the 2 s socket timeout
        finally:
            redis_server.resume()
        wait_idle(client)
        touched = [s for s in range(8, 16) if not (pool.array[s] == MARK).all()]
        assert touched == [], f"slots {touched} were written after the load was given up"
        stats = client.stats()
        assert stats is not None and stats.remote is not None
        assert stats.remote.extra["late_aborted"] > 0  # stopped by the job's deadline...
        assert stats.remote.extra["breaker_trips"] == 0  # ...which is no outage
        # Nothing broke: Redis answers again and the same pages load, whole.
        _remote_up(client)
        [again] = client.wait([client.submit_load(hashes, list(range(8, 16)))], 30)
        assert again.pages_ok == 8
        assert np.array_equal(pool.array[8:16], pool.array[0:8])
    finally:
        client.close()
        service.stop()
