"""A real cache service process with a remote tier (redis-server and valkey-server): a clear
through the service empties both tiers of the namespace, and the KV events of both tiers
rebuild what its contents reply lists."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from pools import NAMESPACE, SMALL, Pool, chain
from redis_server import RedisServer
from service_process import ServiceProcess

from asynchicache.common.keys import Namespace
from asynchicache.common.tiers import AllBlocksCleared, BlockRemoved, BlockStored
from asynchicache.storage.admin_messages import ClearedPages
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient

PAGE = SMALL.shape[2]
NS = Namespace("m", "float32", PAGE)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="acr-"))  # short: ipc paths are limited to ~107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_clear_and_events_of_both_tiers(
    kv_server: RedisServer, make_pool: Callable[..., Pool], sock_dir: Path, tmp_path: Path
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    service = ServiceProcess(tmp_path / "kv", addr, "--remote-url", kv_server.url).start()
    pool = make_pool(32, fill=32)
    client = StorageClient(ClientConfig(addr, NAMESPACE, pool.segment.name, SMALL, events=True))
    try:
        assert client.wait_ready(30)
        wait_for(lambda: bool(client.stats().remote.extra["available"]), "the remote tier")  # type: ignore[union-attr]
        raw = redis.Redis(port=kv_server.port)
        raw.set(b"someone-else:key", b"v")
        salt = NS.with_salt("tenant").digest()
        runs = [chain(NS.digest(), 0, 8), chain(salt, 0, 6, 8)]
        for run in runs:
            [done] = client.wait([client.submit_store(run)], 30)
            assert done.pages_ok == len(run)
        wait_for(lambda: raw.dbsize() == 15, "the uploads")
        tiers: dict[str, set[bytes]] = {"disk": set(), "remote": set()}

        def apply() -> None:
            client.poll()
            for _, event in client.take_events().events:
                if isinstance(event, BlockStored):
                    tiers[event.tier] |= set(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    tiers[event.tier] -= set(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    tiers[event.tier].clear()

        def agrees() -> bool:
            apply()
            contents = client.contents()
            assert contents is not None and contents.remote_listed
            return tiers["disk"] == set(contents.disk_hashes) and tiers["remote"] == set(
                contents.remote_hashes
            )

        wait_for(agrees, "events to match the contents")
        assert len(tiers["disk"]) == len(tiers["remote"]) == 14

        salt_clear = client.clear(root=salt)
        assert salt_clear is not None
        assert salt_clear.tiers == (ClearedPages("disk", 6), ClearedPages("remote", 6))
        wait_for(agrees, "the salt clear's events")
        assert len(tiers["remote"]) == 8 and raw.dbsize() == 9

        everything = client.clear()
        assert everything is not None and everything.removed == 16
        wait_for(agrees, "the clear's events")
        assert tiers == {"disk": set(), "remote": set()}
        assert raw.keys() == [b"someone-else:key"]
    finally:
        client.close()
        assert service.stop() == 0
