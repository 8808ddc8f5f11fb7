"""The cache admin routes and /ready on the real app over the fake engine: bodies are
validated, passed on as typed admin calls, and refusals keep their status (409 for a pin
past the limit). The tiers themselves are tested on live servers (test_cache_ops.py)."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import PIN_LIMIT_TOKENS
from server_helpers import API_KEY, ThreadServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: ThreadServer, path: str, body: object | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)


def test_clear_takes_a_scope_and_a_tenant(server: ThreadServer) -> None:
    default = _post(server, "/cache/clear").json()
    assert default["scope"] == ["device", "host", "disk"] and default["owner"] is None
    one = _post(server, "/cache/clear", {"scope": "remote", "cache_salt": "t1"}).json()
    assert one["scope"] == ["remote"] and one["owner"] and "t1" not in str(one)
    every = _post(server, "/cache/clear", {"scope": ["all"], "include_pinned": True}).json()
    assert every["scope"] == ["device", "host", "disk", "remote"]


@pytest.mark.parametrize(
    "body",
    [{"scope": "ssd"}, {"scope": ["device", 3]}, {"include_pinned": "yes"}, {"tiers": ["disk"]}],
)
def test_clear_refuses_what_it_does_not_know(server: ThreadServer, body: object) -> None:
    r = _post(server, "/cache/clear", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_pin_and_unpin(server: ThreadServer) -> None:
    r = _post(server, "/cache/pin", {"prompt": list(range(40)), "ttl_s": 60})
    assert r.status_code == 200, r.text
    assert r.json()["pages"] == 2 and r.json()["ttl_s"] == 60
    r = _post(server, "/cache/unpin", {"pin_id": "ab" * 16})
    assert r.json() == {"pin_ids": ["ab" * 16], "removed": 1}


def test_pin_over_the_limit_is_409(server: ThreadServer) -> None:
    r = _post(server, "/cache/pin", {"prompt": [5] * (PIN_LIMIT_TOKENS + 16)})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "over_limit"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/cache/pin", {"prompt": [1, 2, 3]}),  # not one full page
        ("/cache/pin", {"prompt": list(range(32)), "ttl_s": 0}),
        ("/cache/pin", {}),
        ("/cache/unpin", {"pin_id": "not-hex"}),
        ("/cache/unpin", {"pin_id": "ab" * 16, "prompt": "x"}),
        ("/cache/lookup", {"prompt": [10**9]}),
    ],
)
def test_bad_pin_bodies_are_400(server: ThreadServer, path: str, body: object) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text


def test_ready_is_public_and_asks_the_engine(server: ThreadServer) -> None:
    r = httpx.get(server.url + "/ready")  # no key
    assert r.status_code == 200 and r.json()["checks"] == {"engine": "ok"}


def test_cache_store_is_a_request_field(server: ThreadServer) -> None:
    body = {"prompt": "hello", "max_tokens": 2, "cache_store": False}
    assert _post(server, "/v1/completions", body).status_code == 200
    body = {"messages": [{"role": "user", "content": "hi"}], "cache_store": "no"}
    assert _post(server, "/v1/chat/completions", body).status_code == 400
