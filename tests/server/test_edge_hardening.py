"""Issue 39, the HTTP edge: findings 1 (stop lists), 2 (/tokenize, /detokenize), 5 (the
work bound counts prompts), 7 (admission), 12 (state-changing routes) and 14 (logit_bias),
against the fake engine (tests/server/fake_engine.py) through the real app under uvicorn.

Each test failed on 9f7c8b6: the stop list of 64 x 1,024 characters, a 1M-id /detokenize,
64 prompts x 250 ids x best_of 2, `"50"` and `"050"` in one logit_bias were all served;
GET /flush_cache emptied the cache, as did a cross-site or rebound browser POST and a
keyless one on a server listening beyond loopback; a burst was never answered 429; a
connection that never finished its request head stayed open.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from fake_engine import SLOW_SEED
from server_helpers import API_KEY, FAKE_CONTEXT, ThreadServer

from asynchicache.config import ServerConfig
from asynchicache.server.context import AppContext, ModelInfo
from asynchicache.server.errors import APIError
from asynchicache.server.frontend import Frontend
from asynchicache.server.requests import MAX_CHOICES, plan_completion
from asynchicache.server.schemas import CompletionRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = {"model": "fake-model", "prompt": "Hello", "max_tokens": 2}


def _assert_400(r: httpx.Response, param: str | None, *words: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


# ------------------------------------------------------------------ 14: logit_bias
def test_logit_bias_names_a_token_once(server: ThreadServer) -> None:
    """'50' and '050' are one token: the engine would add both biases (+200)."""
    body = {**BASE, "logit_bias": {"50": 100, "050": 100}}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    _assert_400(r, "logit_bias", "token 50")
    ok = {**BASE, "logit_bias": {"50": 100, "51": -100}}
    assert httpx.post(server.url + "/v1/completions", json=ok, headers=AUTH, timeout=30).is_success


# ------------------------------------------------------------------ 1: stop lists
def test_a_stop_list_is_bounded_in_total(server: ThreadServer) -> None:
    """64 strings of 1,024 characters each passed the per-string bounds."""
    stops = [f"{i:04d}" + "x" * 1020 for i in range(64)]
    for path, body in (
        ("/v1/completions", BASE),
        ("/v1/chat/completions", {**BASE, "messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = httpx.post(server.url + path, json={**body, "stop": stops}, headers=AUTH, timeout=30)
        _assert_400(r, "stop", "4096 characters")
    within = [f"{i:04d}" + "x" * 60 for i in range(64)]  # 4,096 characters
    r = httpx.post(server.url + "/v1/completions", json={**BASE, "stop": within}, headers=AUTH,
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text[:300]


# ------------------------------------------------------------ 2: tokenize, detokenize
def test_detokenize_is_bounded_by_the_context(server: ThreadServer) -> None:
    raw = json.dumps({"tokens": [7] * 1_000_000}).encode()
    t = time.monotonic()
    r = httpx.post(server.url + "/detokenize", content=raw, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert time.monotonic() - t < 10
    r = httpx.post(server.url + "/detokenize", json={"tokens": [7] * (FAKE_CONTEXT + 1)},
                   headers=AUTH, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/detokenize", json={"tokens": [7] * FAKE_CONTEXT},
                   headers=AUTH, timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.json()["prompt"]


def test_tokenize_is_bounded_by_the_context(server: ThreadServer) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": "7 " * (FAKE_CONTEXT + 10)},
                   headers=AUTH, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(server.url + "/tokenize", json={"prompt": "7 " * 50}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["count"] <= FAKE_CONTEXT


def test_tokenize_errors_keep_their_shape(server: ThreadServer) -> None:
    """Its body is parsed off the event loop now: a bad one is still a 400 naming the field."""
    r = httpx.post(server.url + "/detokenize", json={"tokens": [-1]}, headers=AUTH, timeout=30)
    _assert_400(r, "tokens.0")
    r = httpx.post(server.url + "/tokenize", content=b"{nope", timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ------------------------------------------------------------------ 5: work bound
def test_prompt_tokens_count_in_the_work_bound(server: ThreadServer) -> None:
    """The issue's 64 prompts x 7,000 ids, scaled to the fake context: 64 x 250 ids x
    best_of 2 = 32,000 prompt tokens to compute, past the default bound of 16,384."""
    body = {**BASE, "prompt": [[5] * 250] * 64, "best_of": 2, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    error = _assert_400(r, "prompt", "32000 prompt tokens", "--max-request-tokens")
    assert error["code"] == "request_too_large"


def test_echo_without_completion_counts_its_prompts(server: ThreadServer) -> None:
    """`echo` with `max_tokens: 0` computes every prompt token's logprob."""
    body = {**BASE, "prompt": [[5] * 250] * 70, "echo": True, "max_tokens": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    _assert_400(r, "prompt", "17500 prompt tokens")


class _CountingTokenizer:
    """The real bounded tokenizer, counting `encode` calls."""

    def __init__(self, frontend: Frontend) -> None:
        self.inner = frontend.bounded_tokenizer(FAKE_CONTEXT)
        self.encoded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded += 1
        return self.inner.encode(text, add_special_tokens)


def _plan(tok: _CountingTokenizer, **fields: Any) -> None:
    ctx = AppContext(cast(Any, None), cast(Any, tok), ModelInfo("m", FAKE_CONTEXT, 49152),
                     max_request_tokens=2000)  # fmt: skip
    plan_completion(ctx, CompletionRequest(**{"model": "m", "max_tokens": 1, **fields}))


def test_prompt_count_and_size_are_checked_before_tokenizing(frontend: Frontend) -> None:
    tok = _CountingTokenizer(frontend)
    with pytest.raises(APIError, match=f"more than {MAX_CHOICES}"):
        _plan(tok, prompt=["hello"] * (MAX_CHOICES + 1))
    # 200 texts whose bytes alone prove > 2,000 tokens x best_of: refused unread.
    longest = frontend.max_token_bytes()
    with pytest.raises(APIError, match="--max-request-tokens"):
        _plan(tok, prompt=["a" * (longest * 11)] * 200)
    assert tok.encoded == 0
    with pytest.raises(APIError, match="prompt tokens"):  # and again on the exact count
        _plan(tok, prompt=["a b c d e f g h i j " * 12] * 40)
    assert tok.encoded == 40


# -------------------------------------------------------- 12: state-changing routes
def test_flush_cache_is_post_only(server: ThreadServer) -> None:
    for path in ("/flush_cache", "/clear_hicache_storage_backend"):
        assert httpx.get(server.url + path, headers=AUTH, timeout=30).status_code == 405
    assert httpx.post(server.url + "/flush_cache", headers=AUTH, timeout=30).status_code == 200


def _browser(server: ThreadServer, origin: str | None, host: str | None = None) -> dict[str, str]:
    headers = {**AUTH, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}
    if origin is not None:
        headers["Origin"] = origin
    if host is not None:
        headers["Host"] = host
    return headers


def test_cross_site_and_rebound_browser_requests_are_refused(server: ThreadServer) -> None:
    port = server.port
    evil = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    rebound = {
        "Origin": f"http://evil.example:{port}",
        "Host": f"evil.example:{port}",
        "Sec-Fetch-Site": "same-origin",
    }  # DNS rebinding: same origin to the browser
    for headers in (evil, rebound):
        for path, body in (("/flush_cache", None), ("/cache/clear", {}),
                           ("/v1/completions", BASE)):  # fmt: skip
            r = httpx.post(server.url + path, json=body, headers={**AUTH, **headers}, timeout=30)
            assert r.status_code == 403, (path, headers, r.text)
            assert r.json()["error"]["type"] == "permission_error"
    same = {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    r = httpx.post(server.url + "/flush_cache", headers={**AUTH, **same}, timeout=30)
    assert r.status_code == 200, r.text
    # Not a browser (no Origin, no Sec-Fetch-*): curl, SDKs, proxies.
    assert httpx.post(server.url + "/flush_cache", headers=AUTH, timeout=30).status_code == 200


@pytest.fixture
def exposed(fake_engine: Path, frontend: Frontend) -> Iterator[ThreadServer]:
    """No key at all, listening on every address."""
    srv = ThreadServer(fake_engine, frontend, None,
                       config=ServerConfig(host="0.0.0.0", log_level="warning"))  # fmt: skip
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


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
    srv = ThreadServer(fake_engine, frontend, None, config=config)
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


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
