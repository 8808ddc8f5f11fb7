"""Two `asynchicache serve` instances, separate disk folders, one shared redis-server.

Instance B serves a long prompt that A computed, from L4, with A's greedy
answer, in a fraction of B's own cold time; then Redis is killed and
restarted while B is under load, and no request fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis_server import RedisServer
from serve_process import ServeProcess, shutdown_together, start_together
from settling import settled
from traffic import by_tier, inventory, timed_chat

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def wait_uploads_settle(server: RedisServer, at_least: int, timeout_s: float = 60.0) -> int:
    """Wait until the key count reaches `at_least` and stops changing (uploads are async)."""
    raw = redis.Redis(port=server.port)
    return settled(lambda: int(raw.dbsize()), at_least, "keys in Redis", 1.0, timeout_s)


@pytest.fixture(scope="module")
def shared_redis(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def instances(
    shared_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    root = tmp_path_factory.mktemp("two")
    started: list[ServeProcess] = []
    for name in ("a", "b"):
        flags = ["--disk-cache-dir", str(root / f"kv-{name}"), "--device-cache-tokens", "4096"]
        started.append(ServeProcess(root / f"{name}.log", *flags, "--remote-url", shared_redis.url))
    try:
        # A first short request pays one-time costs, so cold times measure prefill only.
        start_together(started, lambda s: timed_chat(s.url, [{"role": "user", "content": "Hi!"}]))
        yield started[0], started[1]
    finally:
        codes = shutdown_together(started)
        assert all(code == 0 for code in codes), [s.log_tail() for s in started]


def test_second_instance_serves_the_first_ones_prompt_from_redis(
    instances: tuple[ServeProcess, ServeProcess], shared_redis: RedisServer
) -> None:
    a, b = instances
    # What L4 saves in time is a benchmark's claim (docs/benchmarks.md); here: B
    # computes none of A's prompt's cached pages and answers as A did.
    cold_a, text_a, _ = timed_chat(a.url, inventory(seed=0))
    wait_uploads_settle(shared_redis, at_least=1400 // 16)
    ttft_b, text_b, usage = timed_chat(b.url, inventory(seed=0))
    tiers = by_tier(usage)
    print(f"\nA cold TTFT {cold_a:.3f}s, B from L4 TTFT {ttft_b:.3f}s, tiers {tiers}")
    assert usage.prompt_tokens >= 1500  # type: ignore[attr-defined]
    assert text_b == text_a
    assert usage.prompt_tokens_details.cached_tokens >= 1400  # type: ignore[attr-defined]
    assert tiers["remote"] >= 1400, tiers


def test_redis_killed_and_restarted_under_load(
    instances: tuple[ServeProcess, ServeProcess], shared_redis: RedisServer, tmp_path: Path
) -> None:
    _, b = instances
    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def worker(k: int) -> None:
        with httpx.Client(base_url=b.url, timeout=120) as http:
            i = 0
            while not stop.is_set():
                # Half repeat a prompt (cache hits), half are new (stores and uploads).
                seed = 100 + k if i % 2 else 1000 + 10 * k + i
                body = {
                    "model": MODEL,
                    "messages": inventory(seed, boxes=20),
                    "max_tokens": 4,
                    "temperature": 0,
                }
                try:
                    r = http.post("/v1/chat/completions", json=body)
                    if r.status_code != 200 or not r.json()["choices"][0]["message"]["content"]:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                done[0] += 1
                i += 1

    def completed(n: int, timeout_s: float = 240.0) -> None:
        """Wait until `n` more requests have finished (this machine's speed varies a lot)."""
        target, deadline = done[0] + n, time.monotonic() + timeout_s
        while done[0] < target and time.monotonic() < deadline and not failures:
            time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        completed(3)
        shared_redis.kill()
        before = done[0]
        completed(4)  # served while Redis is dead
        during = done[0] - before
        shared_redis.start()  # same port, empty
        completed(4)
        after = done[0] - before - during
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not failures, failures[:5]
    assert during >= 4 and after >= 4, (during, after)
    # The tier came back: a new prompt's pages reach the restarted Redis.
    timed_chat(b.url, inventory(seed=7))
    wait_uploads_settle(shared_redis, at_least=1400 // 16)
