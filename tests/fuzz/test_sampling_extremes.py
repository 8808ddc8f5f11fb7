"""Extreme numbers in every sampling field, against a live server (issue 22, finding 1).

`{"prompt": "Hello", "max_tokens": 2, "top_p": 1e-50}` once killed the engine,
and every client's stream with it. Hypothesis fills the request schemas of
`/v1/completions` and `/v1/chat/completions` with the numbers that break
arithmetic (0, -0, the smallest subnormal, +-1e-308, +-1e308, NaN, +-inf, ints
past 64 bits, the wrong types), a few fields at a time, the rest ordinary.
Every answer is a 200 (a well-formed completion or stream, every number in it
finite) or a 4xx in OpenAI's error shape; the engine never restarts and the
server is ready at the end. Bounded: 2 x EXAMPLES requests of at most 4 tokens.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from fuzz_settings import fuzz_settings
from hypothesis import HealthCheck, event, given
from hypothesis import strategies as st
from live_server import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# EXAMPLES (the docstring's) is $FUZZ_EXTREME_EXAMPLES, 80 without it
EXTREME = fuzz_settings("FUZZ_EXTREME_EXAMPLES", 80, HealthCheck.function_scoped_fixture)

_FLOATS = [0.0, -0.0, 5e-324, -5e-324, 1e-308, -1e-308, 1e-50, 1e308, -1e308,
           math.nan, math.inf, -math.inf, 1.0000000000000002, 0.9999999999999999]  # fmt: skip
_INTS = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
         -(2**63), -(2**63) - 1, 10**30, -(10**30), 10**400]  # fmt: skip
_WRONG = [True, False, None, "1", "nan", [], {}, [1.0], {"a": 1}]
EXTREMES = st.sampled_from(_FLOATS) | st.sampled_from(_INTS) | st.sampled_from(_WRONG)
_BIAS_KEYS = st.sampled_from(["0", "5", "49151", "49152", "-1", "1e3", "9" * 30, ""])
LOGIT_BIAS = st.dictionaries(_BIAS_KEYS, EXTREMES, max_size=3) | EXTREMES

# The edges of what is accepted: these must be served (and the sampler computes with them).
_TINY = [5e-324, 1e-308, 1e-50]
EDGES = {
    "temperature": [0.0, *_TINY, 1e-5, 2.0],
    "top_p": [*_TINY, 1.0],
    "top_k": [-1, 0, 1, 2**31 - 1],
    "min_p": [0.0, *_TINY, 1.0],
    "presence_penalty": [-2.0, -5e-324, 2.0],
    "frequency_penalty": [-2.0, 5e-324, 2.0],
    "repetition_penalty": [0.01, 100.0],
    "seed": [-(2**63), 0, 2**64 - 1],
    "n": [1, 2],
    "best_of": [2],
    "max_tokens": [1, 4],
    "logprobs": [0, 20],
    "top_logprobs": [0, 20],
    "max_completion_tokens": [1],
}
_EDGE_BIAS = st.dictionaries(st.sampled_from(["0", "5", "49151"]), st.sampled_from([-100.0, 100.0]))


def _field(name: str) -> st.SearchStrategy[Any]:
    """Half the time an edge of the field's range, half the time any extreme."""
    return st.sampled_from(EDGES[name]) | EXTREMES


SAMPLING = {name: _field(name) for name in (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "n", "best_of", "max_tokens",
)}  # fmt: skip
SAMPLING["logit_bias"] = _EDGE_BIAS | LOGIT_BIAS
COMPLETION_ONLY = {"logprobs": _field("logprobs"), "echo": st.booleans()}
CHAT_ONLY = {
    "logprobs": st.booleans() | EXTREMES,
    "top_logprobs": _field("top_logprobs"),
    "max_completion_tokens": _field("max_completion_tokens"),
}


@st.composite
def bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """An ordinary small request with 1 to 4 fields set to extremes."""
    fields = {**SAMPLING, **(CHAT_ONLY if chat else COMPLETION_ONLY)}
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True))
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, 4)), "stream": draw(st.booleans())}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = draw(st.sampled_from(["Hello", [1, 2, 3], ["a", "b"]]))
    for name in chosen:
        body[name] = draw(fields[name])
    return body


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _check(r: httpx.Response, body: dict[str, Any]) -> None:
    where = f"{body!r} -> {r.status_code}: {r.text[:400]}"
    assert r.status_code == 200 or 400 <= r.status_code < 500, where
    if r.status_code != 200:
        assert r.headers["content-type"].startswith("application/json"), where
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, where
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert data and data[-1] == "[DONE]", where
        payloads = [json.loads(d) for d in data[:-1]]
        assert all("error" not in p for p in payloads), where
    else:
        payloads = [r.json()]
        assert payloads[0]["choices"], where
    assert all(_finite(p) for p in payloads), where  # no NaN or Infinity in an answer


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    # allow_nan: NaN and Infinity are not JSON, but clients send them and parsers take them.
    raw = json.dumps(body, allow_nan=True)
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, body)
    return r


@EXTREME
@given(bodies(chat=False))
def test_completions_with_extreme_numbers(http: httpx.Client, body: dict[str, Any]) -> None:
    r = _post(http, "/v1/completions", body)
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many were served


@EXTREME
@given(bodies(chat=True))
def test_chat_with_extreme_numbers(http: httpx.Client, body: dict[str, Any]) -> None:
    r = _post(http, "/v1/chat/completions", body)
    event(f"HTTP {r.status_code}")


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hello", "max_tokens": 1, "repetition_penalty": 1e-308},
        {"prompt": "Hello", "max_tokens": 2, "top_p": 1e-50},
        {"prompt": "Hello", "max_tokens": 2, "top_p": 5e-324, "temperature": 2},
        {"prompt": "Hello", "max_tokens": 2, "temperature": 5e-324},
        {"prompt": "Hello", "max_tokens": 2, "min_p": 1.0, "top_k": 2**31 - 1},
    ],
    ids=["issue-22-penalty", "issue-22-top-p", "subnormal-top-p", "subnormal-t", "min-p-1"],
)
def test_the_bodies_that_once_killed_the_engine(http: httpx.Client, body: dict[str, Any]) -> None:
    r = _post(http, "/v1/completions", body)
    assert r.status_code == (400 if "repetition_penalty" in body else 200), r.text


def test_the_engine_never_restarted(server: LiveServer, http: httpx.Client) -> None:
    """Runs last: the same processes, ready, and a normal request answered."""
    assert server.pids() == server.first_pids  # type: ignore[attr-defined]
    assert http.get("/ready").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
