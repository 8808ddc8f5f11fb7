"""Operating the cache on a live server (SmolLM2, every tier: L1, L2, a disk folder and a
real redis-server): KV events a router rebuilds the tiers from (they agree with
/cache/stats, /cache/lookup and Redis itself; a gap is detected and the replay recovers),
`cache_store: false`, `/cache/clear` by scope and tenant (Redis keys of other namespaces
survive), and `/ready` following the cache service."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis
from cache_ops_helpers import (
    ChainSubscriber,
    complete,
    follow,
    lookup,
    prompt,
    stats,
    wait_idle,
)
from ports import free_port
from processes import children_of, proc_title
from redis_server import RedisServer, redis_server_binary
from serve_process import ServeProcess, disk_server

from asynchicache.kv_events import wire

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

FOREIGN_KEY = "someone-else:key"


@dataclass
class Live:
    server: ServeProcess
    redis: RedisServer
    sub: ChainSubscriber
    events: str
    replay: str

    @property
    def url(self) -> str:
        return self.server.url

    def remote_pages(self) -> set[bytes]:
        r = redis.Redis(port=self.redis.port)
        try:
            keys = list(r.scan_iter(match="ackv:*", count=1000))
        finally:
            r.close()
        return {bytes.fromhex(k.decode().rsplit(":", 1)[1]) for k in keys}

    def truth(self) -> dict[str, int]:
        s = stats(self.url)
        cache, disk = s["cache"], s["storage"]["disk"]
        return {"device": cache["device"]["cached"], "host": cache["host"]["cached"],
                "disk": disk["pages"], "remote": len(self.remote_pages())}  # fmt: skip

    def settle(self) -> dict[str, int]:
        wait_idle(self.url)
        return follow(self.sub, self.truth)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("ops")
    rds = RedisServer(redis_server_binary(), root / "redis").start()
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = disk_server(
        root / "kv", root / "server.log",
        "--device-cache-tokens", "1024", "--host-cache-gb", "0.05", "--disk-cache-gb", "0.1",
        "--remote-url", rds.url, "--kv-events-endpoint", events,
        "--kv-events-replay-endpoint", replay, "--kv-events-plaintext",
    )  # fmt: skip
    sub: ChainSubscriber | None = None
    try:
        redis.Redis(port=rds.port).set(FOREIGN_KEY, b"not ours")
        server.start()
        sub = ChainSubscriber(events, replay)
        sub.catch_up()
        yield Live(server, rds, sub, events, replay)
    finally:
        if sub is not None:
            sub.close()
        server.shutdown()
        rds.stop()


def test_events_rebuild_every_tier_and_agree_with_stats_and_lookup(live: Live) -> None:
    prompts = [(prompt(k, 12), None) for k in range(6)]  # 72 pages: past L1, L2 and disk
    prompts += [(prompt(100 + k, 10), "tenant-a") for k in range(3)]
    for ids, salt in prompts:
        complete(live.url, ids, **({"cache_salt": salt} if salt else {}))
    complete(live.url, prompts[0][0])  # a hit from a lower tier
    counts = live.settle()
    assert all(counts[t] > 0 for t in ("device", "host", "disk", "remote")), counts
    # The very pages, not only counts: the shared namespace's under their plain names, the
    # 30 salted ones (3 prompts of 10 pages) under keyed ones (kv_events/privacy.py).
    remote = {wire.external_hash(h) for h in live.remote_pages()}
    assert len(live.sub.tiers["remote"]) == len(remote)
    assert len(live.sub.tiers["remote"] - remote) <= 30
    unsalted = [ids for ids, salt in prompts if salt is None]
    agreeing = 0
    for ids in unsalted:
        expected = live.sub.expected_lookup(ids)
        assert lookup(live.url, ids) == expected, ids[:4]
        agreeing += sum(expected.values()) > 0
    assert agreeing >= 3, "too few prompts are cached anywhere: the check proves little"
    assert live.sub.gaps == 0


def test_a_gap_is_detected_and_the_replay_recovers(live: Live) -> None:
    replays = live.sub.replays
    live.sub.disconnect()  # the router is away: batches published now are lost to it
    for k in range(3):
        complete(live.url, prompt(200 + k, 8))
    live.sub.connect()
    time.sleep(0.5)  # the new subscription takes hold
    complete(live.url, prompt(300, 4))
    live.settle()
    assert live.sub.gaps >= 1 and live.sub.replays > replays


def test_cache_store_false_stays_out_of_disk_and_redis(live: Live) -> None:
    private = prompt(400, 6)
    complete(live.url, private, cache_store=False)
    live.settle()
    hashes = live.sub.chain(private)
    assert len(hashes) == 6
    assert set(hashes) & (live.sub.tiers["device"] | live.sub.tiers["host"])  # L1/L2: yes
    remote = {wire.external_hash(h) for h in live.remote_pages()}
    assert not set(hashes) & (live.sub.tiers["disk"] | remote)
    complete(live.url, private)  # the same pages, by a request that stores
    live.settle()
    assert set(hashes) <= live.sub.tiers["disk"] | live.sub.tiers["remote"]


def test_clear_by_scope_and_tenant(live: Live) -> None:
    a, b = prompt(500, 6), prompt(501, 6)
    complete(live.url, a)
    complete(live.url, b, cache_salt="tenant-b")
    live.settle()

    r = httpx.post(live.url + "/cache/clear", json={"scope": "device"}, timeout=120).json()
    assert r["scope"] == ["device"] and r["tiers"]["device"]["removed"] > 0
    assert lookup(live.url, a)["device"] == 0 and lookup(live.url, a)["host"] > 0

    tenant_b = {"scope": ["host", "disk", "remote"], "cache_salt": "tenant-b"}
    r = httpx.post(live.url + "/cache/clear", json=tenant_b, timeout=120).json()
    assert r["tiers"]["disk"]["removed"] >= 6 and r["tiers"]["remote"]["removed"] >= 6, r
    assert sum(lookup(live.url, b, salt="tenant-b").values()) == 0
    assert lookup(live.url, a)["host"] + lookup(live.url, a)["disk"] > 0  # the others' stay
    live.settle()

    r = httpx.post(live.url + "/cache/clear", json={"scope": "all"}, timeout=120).json()
    assert all(t["error"] is None for t in r["tiers"].values()), r
    assert sum(lookup(live.url, a).values()) == 0
    assert live.remote_pages() == set()  # every page key of ours is gone...
    assert redis.Redis(port=live.redis.port).get(FOREIGN_KEY) == b"not ours"  # ...not theirs
    assert live.settle() == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert live.sub.counts() == {"device": 0, "host": 0, "disk": 0, "remote": 0}


def _service_pid(server: ServeProcess) -> int:
    assert server.proc is not None
    for pid in children_of(server.proc.pid):
        if "cache-service" in proc_title(pid):
            return pid
    raise AssertionError("no cache-service child")


def test_ready_follows_the_cache_service(live: Live) -> None:
    assert httpx.get(live.url + "/ready").status_code == 200
    pid = _service_pid(live.server)
    os.kill(pid, signal.SIGSTOP)  # alive but silent: the server recomputes, slowly
    try:
        r = httpx.get(live.url + "/ready", timeout=30)
        assert r.status_code == 503 and "cache_service" in r.json()["reason"], r.text
        assert httpx.get(live.url + "/health").status_code == 200  # liveness: still alive
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while httpx.get(live.url + "/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "not ready again after the service woke up"
        time.sleep(0.5)
