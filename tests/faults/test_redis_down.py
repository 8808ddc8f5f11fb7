"""The remote tier (a real redis-server) goes down under load and comes back.

While it is down, requests are served from L1-L3 and by recompute (zero failures,
same answers) and its stores fail (counted); once it is back, new pages reach it
again without a restart of anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_helpers import FaultRecord, knob, record
from live_server import LiveServer
from redis_server import RedisServer, redis_server_binary
from settling import wait_until
from traffic import Load, make_prompts, references

from asynchicache.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _remote(server: LiveServer) -> dict:
    return (server.stats().get("storage") or {}).get("remote") or {}


def _wait(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    wait_until(predicate, what, timeout_s, every_s=0.25)


def _phase(load: Load, seconds: float) -> None:
    """Load for `seconds`, or until as many more requests as it has prompts were served."""
    load.served_more(len(load.prompts), seconds)


def _keys(redis: RedisServer) -> int:
    return int(redis.cli("dbsize"))


def test_redis_down_and_back_under_load(tmp_path: Path, tok: Tokenizer) -> None:
    redis = RedisServer(redis_server_binary(), tmp_path / "redis").start()
    server = LiveServer(tmp_path / "kv", tmp_path / "server.log", "--remote-url", redis.url)
    clients, phase = knob("clients"), knob("phase_s")
    t0 = time.monotonic()
    try:
        server.start()
        _wait(lambda: _remote(server).get("extra", {}).get("available") == 1.0, 30, "L4 up")
        up, down, back = (make_prompts(tok, tag, knob("redis_prompts")) for tag in "udb")
        expected = references(server.url, up, clients)
        _wait(lambda: _keys(redis) > 0, 30, "pages in Redis")
        with Load(server.url, up, expected, clients) as load:
            _phase(load, phase / 2)
            redis.kill()
            expected |= references(server.url, down, clients)  # their L4 stores fail
            load.prompts += down
            _phase(load, phase / 2)
            remote_down = _remote(server)
            disk_extra = (server.stats()["storage"].get("disk") or {}).get("extra", {})
            uploads_down = {k: v for k, v in disk_extra.items() if k.startswith("remote-upload")}
            failures_down = remote_down.get("store_failures", 0)
            skipped_down = remote_down.get("extra", {}).get("skipped_down", 0)
            unavailable = _remote(server).get("extra", {}).get("available") == 0.0
            redis.start()  # same port, empty: a restarted cache without persistence
            _wait(lambda: _remote(server).get("extra", {}).get("available") == 1.0, 60, "L4 back")
            expected |= references(server.url, back, clients)
            load.prompts += back
            _wait(lambda: _keys(redis) > 0, 60, "new pages in the restarted Redis")
            _phase(load, phase / 2)
        result = load.result
        keys_after = _keys(redis)
        record(
            FaultRecord(
                "Redis (L4) down and back",
                2,
                result.served + 3 * len(up),
                result.failed,
                result.wrong,
                seconds=time.monotonic() - t0,
                notes={
                    "remote_store_failures_while_down": failures_down,
                    "remote_ops_skipped_while_down": skipped_down,
                    "uploads_while_down": uploads_down,
                    "reported_unavailable": unavailable,
                    "keys_after_restart": keys_after,
                    "cached_tokens_by_tier": result.tiers,
                },
            )
        )
        assert result.failed == 0 and result.wrong == 0, result.failures[:10]
        assert unavailable, "the remote tier was never marked down"
        assert keys_after > 0
    finally:
        server.shutdown()
        redis.stop()
