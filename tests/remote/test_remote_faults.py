"""The remote tier when Redis dies, hangs, or is not there yet: no exception, no stall."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from pools import Pool, new_hashes, refs
from ports import free_port
from redis_server import RedisServer
from remote_helpers import Backends


def _timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def test_killed_mid_run_then_restarted(
    redis_servers: Callable[..., RedisServer],
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
) -> None:
    server = redis_servers()
    pool = make_pool(16, fill=8)
    backend = remote_backends(server.url, socket_timeout_s=1.0)
    hashes = new_hashes(8)
    assert backend.put(refs(hashes, range(8)), pool.array) == 8
    server.kill()
    # The first call finds the dead connection; it and every later call return at once.
    got, seconds = _timed(lambda: backend.get(hashes, list(range(8, 16)), pool.array))
    assert got == 0 and seconds < 1.0
    assert not backend.available
    for call in (
        lambda: backend.exists(hashes),
        lambda: backend.get(hashes, list(range(8, 16)), pool.array),
        lambda: backend.put(refs(hashes, range(8)), pool.array),
        lambda: backend.delete(hashes),
        lambda: backend.clear().removed,
    ):
        got, seconds = _timed(call)
        assert got == 0 and seconds < 0.05
    stats = backend.stats()
    assert stats.extra["breaker_trips"] == 1 and stats.extra["skipped_down"] >= 5
    # Redis comes back on the same port (empty: no persistence); the prober finds it.
    redis_servers(port=server.port)
    assert backend.wait_available(5.0)
    assert backend.exists(hashes) == 0
    assert backend.put(refs(hashes, range(8)), pool.array) == 8
    assert backend.get(hashes, list(range(8, 16)), pool.array) == 8
    assert np.array_equal(pool.array[8:16], pool.array[0:8])


def test_unreachable_at_start_then_appears(
    redis_servers: Callable[..., RedisServer],
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
) -> None:
    port = free_port()
    pool = make_pool(4, fill=2)
    backend = remote_backends(f"redis://127.0.0.1:{port}/0", wait=False)
    hashes = new_hashes(2)
    assert not backend.wait_available(0.3)
    got, seconds = _timed(lambda: backend.put(refs(hashes, range(2)), pool.array))
    assert got == 0 and seconds < 0.05
    assert backend.stats().extra["probes_failed"] >= 1
    redis_servers(port=port)
    assert backend.wait_available(5.0)
    assert backend.put(refs(hashes, range(2)), pool.array) == 2
    assert backend.get(hashes, [2, 3], pool.array) == 2


def test_hung_server_costs_one_timeout_then_nothing(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8, fill=4)
    backend = remote_backends(
        redis_server.url, socket_timeout_s=0.3, control_timeout_s=0.2, connect_timeout_s=0.2
    )
    hashes = new_hashes(4)
    assert backend.put(refs(hashes, range(4)), pool.array) == 4
    redis_server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        got, seconds = _timed(lambda: backend.get(hashes, [4, 5, 6, 7], pool.array))
        assert got == 0 and seconds < 1.5
        assert not backend.available
        got, seconds = _timed(lambda: backend.exists(hashes))
        assert got == 0 and seconds < 0.05
    finally:
        redis_server.resume()
    assert backend.wait_available(5.0)
    assert backend.get(hashes, [4, 5, 6, 7], pool.array) == 4


def test_concurrent_callers_survive_kill_and_restart(
    redis_servers: Callable[..., RedisServer],
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
) -> None:
    """Four threads store and load while Redis is killed and restarted: no exception escapes."""
    server = redis_servers()
    pool = make_pool(64, fill=32)
    backend = remote_backends(server.url, socket_timeout_s=1.0)
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = [0]

    def worker(k: int) -> None:
        base = 8 * k
        try:
            while not stop.is_set():
                hashes = new_hashes(8)
                backend.put(refs(hashes, range(base, base + 8)), pool.array)
                n = backend.get(hashes, list(range(32 + base, 40 + base)), pool.array)
                if n:
                    assert np.array_equal(
                        pool.array[32 + base : 32 + base + n], pool.array[base : base + n]
                    )
                backend.exists(hashes)
                calls[0] += 1
        except BaseException as exc:  # the test fails on any
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    server.kill()
    time.sleep(0.5)
    down_calls = calls[0]
    redis_servers(port=server.port)
    assert backend.wait_available(5.0)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not errors, errors
    assert calls[0] > down_calls  # work went on after the restart
    assert backend.stats().extra["breaker_trips"] >= 1


def test_idle_connections_closed_by_the_server_are_replaced(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    """Redis's `timeout` (or a proxy) closes idle clients: that is not an outage."""
    pool = make_pool(16, fill=8)
    backend = remote_backends(redis_server.url, io_threads=2, batch_pages=2)
    hashes = new_hashes(8)
    assert backend.put(refs(hashes, range(8)), pool.array) == 8
    redis_server.cli("config", "set", "timeout", "1")
    deadline = time.monotonic() + 10
    while int(redis_server.cli("info", "clients").split("connected_clients:")[1].split()[0]) > 2:
        assert time.monotonic() < deadline, "Redis did not close the idle connections"
        time.sleep(0.2)
    assert backend.get(hashes, list(range(8, 16)), pool.array) == 8
    assert np.array_equal(pool.array[8:16], pool.array[0:8])
    stats = backend.stats()
    assert stats.extra["breaker_trips"] == 0 and stats.extra["stale_retries"] >= 1
