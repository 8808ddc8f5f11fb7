"""Issue 39, finding 3: admin reads never hold the engine's thread on the cache service,
and a full integrity scan is the admin's, rate-limited.

`/metrics` and `/cache/stats` asked the engine for its stats, and the engine asked the
cache service, synchronously, on its own thread: a stopped service held every step
0.5 s per scrape. Now the engine answers from the service's latest snapshot (asking
for the next one without waiting); the HTTP side waits, on its event loop, for a
snapshot from after the call. `?integrity=true` (a walk of the whole cache on the
engine's thread) was open to user keys: now 403 for them, and 429 with Retry-After
within INTEGRITY_INTERVAL_S of the last scan.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from keyed_server import ADMIN_KEY, KEY, auth
from live_server import LiveServer
from service_process import ServiceProcess

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import AdminRequest
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    sock_dir = Path(tempfile.mkdtemp(prefix="acad-"))
    svc = ServiceProcess(tmp_path / "kv", f"ipc://{sock_dir}/s.sock").start()
    yield svc
    svc.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)


def _stats_s(engine: Engine) -> tuple[float, dict]:
    t0 = time.monotonic()
    reply = engine.admin(AdminRequest("s", "stats"))
    return time.monotonic() - t0, reply.payload


def test_engine_stats_never_wait_on_a_stopped_service(
    smollm: LoadedModel, service: ServiceProcess, tmp_path: Path
) -> None:
    address = service.argv[service.argv.index("--socket") + 1]
    client = StorageClient(ClientConfig(address))
    cache = CacheConfig(disk_cache_dir=tmp_path / "kv", host_cache_gb=0.05)
    engine = Engine(EngineConfig(), cache, storage=client, loaded=smollm)
    try:
        assert client.wait_ready(30.0)
        deadline = time.monotonic() + 30
        while "disk" not in _stats_s(engine)[1]["storage"]:  # the first snapshot arrives
            assert time.monotonic() < deadline
            engine.cache.poll()
            time.sleep(0.02)
        os.kill(service.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # the snapshot is old now: each call asks for the next one
            took = [_stats_s(engine)[0] for _ in range(3)]
            payload = _stats_s(engine)[1]
        finally:
            os.kill(service.pid, signal.SIGCONT)
    finally:
        engine.close()
        client.close()
    # Before: each call waited STORAGE_STATS_TIMEOUT_S (0.5 s) for the stopped service.
    assert max(took) < 0.25, took
    assert "disk" in payload["storage"]  # the last snapshot, with when it was taken
    assert payload["storage"]["at_monotonic_s"] < time.monotonic() - 1.0


def test_integrity_scans_are_the_admins_and_rate_limited(server: LiveServer) -> None:
    url = server.url + "/cache/stats"
    user = httpx.get(url, params={"integrity": "true"}, headers=auth(KEY), timeout=30)
    assert user.status_code == 403, user.text
    assert "integrity" in user.json()["error"]["message"]
    assert httpx.get(url, headers=auth(KEY), timeout=30).status_code == 200  # plain stats
    first = httpx.get(url, params={"integrity": "true"}, headers=auth(ADMIN_KEY), timeout=30)
    assert first.status_code == 200 and first.json()["integrity"]["ok"]
    again = httpx.get(url, params={"integrity": "true"}, headers=auth(ADMIN_KEY), timeout=30)
    assert again.status_code == 429, again.text
    assert int(again.headers["Retry-After"]) >= 1
    time.sleep(float(again.headers["Retry-After"]))
    later = httpx.get(url, params={"integrity": "true"}, headers=auth(ADMIN_KEY), timeout=30)
    assert later.status_code == 200
