"""Issue 39, findings 7 and 12 (the keyless server beyond loopback), against the fake
engine with servers of their own configuration (tests/server/fake_engine.py).

Each server here is alone on the module's fake engine: two servers on one engine share
its output socket, which hands each message to one of them (ZeroMQ PUSH), so a request
of one would lose its tokens to the other. On 9f7c8b6 a keyless server listening on
every address emptied its cache for anyone, a burst was never answered 429, and a
connection that never finished its request head stayed open.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_engine import SLOW_SEED
from server_helpers import ThreadServer

from asynchicache.launch.frontend import Frontend
from asynchicache.settings.config import ServerConfig

BASE = {"model": "fake-model", "prompt": "Hello", "max_tokens": 2}


@pytest.fixture
def exposed(fake_engine: Path, frontend: Frontend) -> Iterator[ThreadServer]:
    """No key at all, listening on every address."""
    config = ServerConfig(host="0.0.0.0", log_level="warning")
    with ThreadServer(fake_engine, frontend, None, config=config) as srv:
        yield srv


def test_state_changing_routes_want_a_key_beyond_loopback(exposed: ThreadServer) -> None:
    for path in ("/flush_cache", "/clear_hicache_storage_backend", "/cache/clear"):
        r = httpx.post(exposed.url + path, json={}, timeout=30)
        assert r.status_code == 403, (path, r.text)
        assert "--admin-api-key" in r.json()["error"]["message"]
    assert httpx.post(exposed.url + "/v1/completions", json=BASE, timeout=30).status_code == 200


# ------------------------------------------------------------------ 7: admission
@pytest.fixture
def narrow(fake_engine: Path, frontend: Frontend) -> Iterator[ThreadServer]:
    """Two requests at once, four waiting, a 1 s request-head timeout; no key, so every
    bearer token is a different client."""
    config = ServerConfig(log_level="warning", max_concurrent_requests=2,
                          max_waiting_requests=4, header_timeout_s=1.0)  # fmt: skip
    with ThreadServer(fake_engine, frontend, None, config=config) as srv:
        yield srv


# The fake engine echoes the prompt, a token each 0.2 s for this seed: 5 s each, so a
# burst fired from threads on a loaded machine is all in before the first one ends.
SLOW = {**BASE, "prompt": [5] * 32, "seed": SLOW_SEED, "max_tokens": 25}


def _fire(url: str, key: str, out: list[httpx.Response]) -> threading.Thread:
    def run() -> None:
        headers = {"Authorization": f"Bearer {key}"}
        out.append(httpx.post(url + "/v1/completions", json=SLOW, headers=headers, timeout=120))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _first_refusal(out: list[httpx.Response]) -> None:
    """Wait until one of the fired requests came back 429 (the queue is full)."""
    deadline = time.monotonic() + 60
    while not any(r.status_code == 429 for r in list(out)):
        assert time.monotonic() < deadline, [r.status_code for r in out]
        time.sleep(0.02)


def test_a_burst_past_the_queue_is_answered_429(narrow: ThreadServer) -> None:
    out: list[httpx.Response] = []
    threads = [_fire(narrow.url, "a", out) for _ in range(10)]
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in out)
    assert codes == [200] * 6 + [429] * 4, codes
    refused = next(r for r in out if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "--max-waiting-requests" in error["message"]


def test_one_keys_burst_leaves_room_for_another(narrow: ThreadServer) -> None:
    """Key a fills both running slots and the whole queue; key b still gets in (one of a's
    waiting requests makes room for it), instead of a 429."""
    out: list[httpx.Response] = []
    threads = [_fire(narrow.url, "a", out) for _ in range(7)]  # 2 run, 4 wait, 1 refused
    _first_refusal(out)
    other = httpx.post(narrow.url + "/v1/completions", json=SLOW, timeout=120,
                       headers={"Authorization": "Bearer b"})  # fmt: skip
    for t in threads:
        t.join(120)
    assert other.status_code == 200, other.text
    refused = [r for r in out if r.status_code == 429]
    assert sorted(r.status_code for r in out) == [200] * 5 + [429] * 2
    assert any("its share" in r.json()["error"]["message"] for r in refused)


def test_a_request_head_that_never_ends_is_cut_off(narrow: ThreadServer) -> None:
    with socket.create_connection(("127.0.0.1", narrow.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        t = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server, not by our 10 s timeout
        assert time.monotonic() - t < 8
