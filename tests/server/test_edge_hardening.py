"""Issue 39, the HTTP edge: findings 1 (stop lists), 2 (/tokenize, /detokenize), 5 (the
work bound counts prompts), 12 (state-changing routes) and 14 (logit_bias), against the
fake engine (tests/server/fake_engine.py) through the real app under uvicorn; finding 7
(admission) and the keyless server beyond loopback: test_admission_live.py.

Each test failed on 9f7c8b6: the stop list of 64 x 1,024 characters, a 1M-id /detokenize,
64 prompts x 250 ids x best_of 2, `"50"` and `"050"` in one logit_bias were all served;
GET /flush_cache emptied the cache, as did a cross-site or rebound browser POST.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import httpx
import pytest
from server_helpers import API_KEY, FAKE_CONTEXT, ThreadServer

from asynchicache.launch.frontend import Frontend
from asynchicache.server.context import AppContext, ModelInfo
from asynchicache.server.errors import APIError
from asynchicache.server.openai.requests import MAX_CHOICES, plan_completion
from asynchicache.server.openai.schemas import CompletionRequest

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
