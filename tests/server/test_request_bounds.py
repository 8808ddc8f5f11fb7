"""Every sampling field is bounded at the edge, and so is the work one request asks.

Against the fake engine (tests/server/fake_engine.py): what reaches it was already
checked, so each case is about the HTTP layer's answer alone: a 400 in OpenAI's
error shape whose `param` names the field. Issue 22: `repetition_penalty` 1e-308
passed the edge and killed the engine; a 100-byte body with n=32, best_of=32,
logprobs=20 and max_tokens=1000 cost 462 s of engine time and a 17 MB answer.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, FAKE_CONTEXT, ThreadServer

from asynchicache.server.errors import APIError

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
BASE = {"model": "fake-model", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (field, value): each outside what the sampler computes with.
OUT_OF_BOUNDS: list[tuple[str, Any]] = [
    ("repetition_penalty", 1e-308),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e308),
    ("repetition_penalty", float("nan")),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", 1e308),
    ("temperature", -1e-308),
    ("top_p", 0.0),
    ("top_p", float("nan")),
    ("top_p", 1.0000001),
    ("min_p", -1e-308),
    ("min_p", 1.5),
    ("min_p", float("nan")),
    ("top_k", -2),
    ("top_k", 2**64),
    ("top_k", 1.5),
    ("presence_penalty", float("-inf")),
    ("frequency_penalty", 1e308),
    ("frequency_penalty", float("nan")),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 1.5),
    ("n", 0),
    ("n", 2**70),
    ("best_of", 33),
    ("logprobs", 21),
    ("logprobs", -1),
    ("max_tokens", -1),
    ("max_tokens", 2**70),
    ("max_tokens", 1.0),
    ("logit_bias", {"5": float("nan")}),
    ("logit_bias", {"5": 1e308}),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}),
    ("stop", ["x"] * 65),
    ("stop", "y" * 1025),
]


def _post(server: ThreadServer, path: str, body: dict[str, Any]) -> httpx.Response:
    # allow_nan: NaN and Infinity are not JSON, but clients send them and parsers take them.
    raw = json.dumps(body, allow_nan=True)
    return httpx.post(server.url + path, content=raw, headers=AUTH, timeout=30)


def _assert_400(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("field", "value"), OUT_OF_BOUNDS, ids=lambda v: repr(v)[:20])
def test_out_of_bounds_sampling_fields_are_a_400_naming_them(
    server: ThreadServer, field: str, value: Any
) -> None:
    _assert_400(_post(server, "/v1/completions", {**BASE, field: value}), field)
    if field not in ("logprobs", "max_tokens"):  # chat's logprobs is a bool
        _assert_400(_post(server, "/v1/chat/completions", {**CHAT, field: value}), field)


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 0.01), ("repetition_penalty", 100.0), ("top_p", 5e-324),
     ("temperature", 5e-324), ("min_p", 1.0), ("min_p", 0.0), ("seed", -(2**63)),
     ("seed", 2**64 - 1), ("top_k", 2**31 - 1), ("logit_bias", {"5": -100.0})],
)  # fmt: skip
def test_edge_values_inside_the_bounds_are_served(
    server: ThreadServer, field: str, value: Any
) -> None:
    for path, body in (("/v1/completions", BASE), ("/v1/chat/completions", CHAT)):
        r = _post(server, path, {**body, field: value})
        assert r.status_code == 200, (path, field, value, r.text[:300])


def test_errors_do_not_echo_the_prompt(server: ThreadServer) -> None:
    secret = "tenant-secret-prompt-text"
    r = _post(server, "/v1/completions", {**BASE, "prompt": secret, "top_p": 2.0})
    assert secret not in r.text
    r = _post(server, "/v1/completions", {**BASE, "prompt": secret, "max_tokens": 10**6})
    assert r.status_code == 400 and secret not in r.text


# ----------------------------------------------------------------- work bound
def test_the_462_second_request_is_refused(server: ThreadServer) -> None:
    """The issue's body, scaled to the fake engine's context: 8 prompts x best_of 32 x
    200 tokens = 51,200 generated tokens, past the default bound of 16,384."""
    body = {**BASE, "prompt": ["Hello"] * 8, "n": 32, "best_of": 32, "max_tokens": 200}
    error = _assert_400(_post(server, "/v1/completions", body), "max_tokens")
    assert "51200 tokens" in error["message"] and "--max-request-tokens" in error["message"]
    assert error["code"] == "request_too_large"


def test_logprobs_are_bounded_too(server: ThreadServer) -> None:
    """n 32 x 200 tokens x (1 + 20) = 134,400 logprob entries > 4 x 16,384."""
    body = {**BASE, "n": 32, "max_tokens": 200, "logprobs": 20}
    _assert_400(_post(server, "/v1/completions", body), "logprobs")
    chat = {**CHAT, "n": 32, "max_tokens": 200, "logprobs": True, "top_logprobs": 20}
    _assert_400(_post(server, "/v1/chat/completions", chat), "top_logprobs")
    fewer = {**body, "logprobs": 5, "n": 4}  # 4 x 200 x 6 = 4,800 entries: served
    assert _post(server, "/v1/completions", fewer).status_code == 200


def test_work_bound_rules() -> None:
    from asynchicache.server.guards.work_bound import (
        DEFAULT_MAX_REQUEST_TOKENS,
        Work,
        check_work,
        fit_default,
        request_token_limit,
    )

    assert request_token_limit(None, FAKE_CONTEXT) == DEFAULT_MAX_REQUEST_TOKENS
    assert request_token_limit(None, 32_768) == 65_536  # two whole contexts
    assert request_token_limit(100, 32_768) == 100  # the flag wins
    work = Work(prompts=2, n=1, best_of=4, logprobs=None)
    check_work(800, work, 100)  # 2 x 4 x 100 = 800: at the bound
    with pytest.raises(APIError, match="808 tokens") as info:
        check_work(800, work, 101)
    assert info.value.param == "max_tokens"
    assert fit_default(800, work, 8000) == 100  # a defaulted max_tokens shrinks to fit
    assert fit_default(800, work, 16) == 16
    assert fit_default(4, work, 16) == 1  # never below one token
    logprobs = Work(prompts=1, n=2, best_of=2, logprobs=3, echo_tokens=10)
    check_work(100, logprobs, 45)  # (2 x 45 + 10) x 4 = 400 = 4 x 100
    with pytest.raises(APIError) as info:
        check_work(100, logprobs, 46)
    assert info.value.param == "logprobs"
