"""Property-based fuzzing of every HTTP endpoint of a live `asynchicache serve`.

Hypothesis builds JSON bodies of wrong shapes, types and values around each
endpoint's real fields (and some that fit), raw non-JSON bodies, and odd query
strings. Whatever comes in: no 5xx, no error event inside a 200 stream, and the
server is healthy with the same processes at the end. The server is the fuzz
folder's (conftest.py: `--max-model-len 48`).

A second family of strategies builds only valid combinations of the OpenAI
fields (n, best_of, logprobs, top_logprobs, echo with max_tokens 0, prompt
lists, penalties, logit_bias, streaming): each must answer 200 with a choice
per prompt and sample.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from fuzz_settings import fuzz_settings
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from live_server import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

FUZZ = fuzz_settings("FUZZ_HTTP_EXAMPLES", 60, HealthCheck.function_scoped_fixture)
MODEL = "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------- strategies

_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, st.text(max_size=30))
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=15,
)
_TOKENS = st.lists(st.integers(-5, 50_000) | st.sampled_from([10**9, -(2**40)]), max_size=20)
_MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "root", ""])
        | _JSON,
        "content": st.text(max_size=40)
        | st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["text", "image"]) | _JSON,
                    "text": st.text(max_size=20) | _JSON,
                }
            )
        )
        | _JSON,
        "name": st.text(max_size=8) | _JSON,
    },
)
_SAMPLING = {
    "model": st.sampled_from([MODEL, "gpt-4", ""]) | _JSON,
    "max_tokens": st.integers(-3, 60) | _JSON,
    "temperature": st.floats(-1, 3) | _JSON,
    "top_p": st.floats(-0.5, 1.5) | _JSON,
    "top_k": st.integers(-3, 100) | _JSON,
    "seed": _NUMBERS | _JSON,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | _JSON,
    "n": st.integers(-1, 3) | _JSON,
    "best_of": st.integers(-1, 3) | _JSON,
    "stream": st.booleans() | _JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _JSON})
    | _JSON,
    "logprobs": st.booleans() | st.integers(-1, 22) | _JSON,
    "top_logprobs": st.integers(-1, 22) | _JSON,
    "cache_salt": st.text(max_size=10) | _JSON,
    "ignore_eos": st.booleans() | _JSON,
    "echo": st.booleans() | _JSON,
    "suffix": st.text(max_size=5) | _JSON,
    "presence_penalty": st.floats(-3, 3) | _JSON,
    "frequency_penalty": st.floats(-3, 3) | _JSON,
    "repetition_penalty": st.floats(-1, 3) | _JSON,
    "logit_bias": st.dictionaries(
        st.text(max_size=6) | st.integers(-5, 60_000).map(str),
        st.floats(-150, 150) | _JSON,
        max_size=4,
    )
    | _JSON,
}
_PROMPT = (
    st.text(max_size=60)
    | _TOKENS
    | st.lists(_TOKENS, max_size=3)
    | st.lists(st.text(max_size=10), max_size=3)
    | _JSON
)
_MESSAGES = st.lists(_MESSAGE, max_size=4) | _JSON


def _body(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Mostly dicts over the endpoint's own fields (some extra keys); sometimes any JSON."""
    dicts = st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=6), _JSON, max_size=2).map(lambda x: {**x, **d})
    )
    return st.one_of(dicts, dicts, dicts, _JSON)


COMPLETION = _body({**_SAMPLING, "prompt": _PROMPT})
CHAT = _body(
    {**_SAMPLING, "messages": _MESSAGES, "max_completion_tokens": st.integers(-2, 60) | _JSON}
)
LOOKUP = _body(
    {"prompt": _PROMPT, "messages": _MESSAGES, "cache_salt": st.text(max_size=8) | _JSON}
)


# Valid combinations (each must answer 200). Plain-ASCII words keep every prompt under
# 30 tokens (a chat message under 10, after a ~31-token template), so prompt +
# max_tokens always fits the 48-token context.
_WORDS = st.text(alphabet="abcdefgh ijklmnop", min_size=1, max_size=30)
_CHAT_WORDS = st.text(alphabet="abcdefgh ijklmnop", min_size=1, max_size=8)
_VALID_IDS = st.lists(st.integers(0, 49_151), min_size=1, max_size=20)
_BIAS = st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=3)
_VALID_COMMON = {
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0]),
    "top_p": st.floats(0.1, 1.0),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2.0),
    "logit_bias": _BIAS,
    "stop": st.lists(st.sampled_from(["a", "b c", "\n"]), max_size=2),
}


@st.composite
def valid_completion(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    stream = draw(st.booleans())
    best_of = n if stream else draw(st.integers(n, 4))
    echo = draw(st.booleans())
    body: dict[str, Any] = draw(st.fixed_dictionaries({}, optional=_VALID_COMMON))
    prompt = draw(
        _WORDS
        | _VALID_IDS
        | st.lists(_WORDS, min_size=1, max_size=3)
        | st.lists(_VALID_IDS, min_size=1, max_size=2)
    )
    body.update(
        model=MODEL,
        prompt=prompt,
        n=n,
        stream=stream,
        echo=echo,
        max_tokens=draw(st.integers(0 if echo else 1, 6)),
    )
    if best_of != n or draw(st.booleans()):
        body["best_of"] = best_of
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return body


@st.composite
def valid_chat(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    stream = draw(st.booleans())
    body: dict[str, Any] = draw(st.fixed_dictionaries({}, optional=_VALID_COMMON))
    body.update(
        model=MODEL,
        n=n,
        stream=stream,
        max_tokens=draw(st.integers(1, 4)),
        messages=[{"role": "user", "content": draw(_CHAT_WORDS)}],
    )
    if not stream and draw(st.booleans()):
        body["best_of"] = draw(st.integers(n, 3))
    if draw(st.booleans()):
        body["logprobs"] = True
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 5))
    return body


# ------------------------------------------------------------------------- checks


def _encode(body: Any) -> bytes:
    # allow_nan: NaN/Infinity are not JSON, but clients send them and parsers accept them
    return json.dumps(body, allow_nan=True).encode()


def _check(r: httpx.Response, path: str, body: Any) -> None:
    assert r.status_code < 500, f"{path} {body!r} -> {r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", f"{path} {body!r}: {r.text[-300:]}"
        for line in lines[:-1]:
            assert "error" not in json.loads(line[6:]), f"{path} {body!r}: {line}"
    else:
        r.json()


def _post(http: httpx.Client, path: str, body: Any) -> None:
    r = http.post(path, content=_encode(body), headers={"Content-Type": "application/json"})
    _check(r, path, body)


@FUZZ
@given(COMPLETION)
def test_completions(http: httpx.Client, body: Any) -> None:
    _post(http, "/v1/completions", body)


def _choices(r: httpx.Response) -> dict[int, int]:
    """Choice index -> how many chunks (or choices) ended it with a finish_reason."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        payloads = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    else:
        payloads = [r.json()]
    ends: dict[int, int] = {}
    for payload in payloads:
        for choice in payload["choices"]:
            ends.setdefault(choice["index"], 0)
            if choice.get("finish_reason"):
                ends[choice["index"]] += 1
    return ends


def _post_ok(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """A valid request: 200 and a well-formed answer (see `_check`)."""
    r = http.post(path, json=body)
    assert r.status_code == 200, f"{body!r} -> {r.status_code}: {r.text[:500]}"
    _check(r, path, body)
    return r


@FUZZ
@given(valid_completion())
def test_valid_completion_combinations(http: httpx.Client, body: dict[str, Any]) -> None:
    r = _post_ok(http, "/v1/completions", body)
    prompts = len(body["prompt"]) if isinstance(body["prompt"][0], str | list) else 1
    prompts = 1 if isinstance(body["prompt"], str) else prompts
    assert _choices(r) == dict.fromkeys(range(prompts * body["n"]), 1), body


@FUZZ
@given(valid_chat())
def test_valid_chat_combinations(http: httpx.Client, body: dict[str, Any]) -> None:
    r = _post_ok(http, "/v1/chat/completions", body)
    assert _choices(r) == dict.fromkeys(range(body["n"]), 1), body


@FUZZ
@given(CHAT)
def test_chat_completions(http: httpx.Client, body: Any) -> None:
    _post(http, "/v1/chat/completions", body)


@FUZZ
@given(LOOKUP)
def test_cache_lookup(http: httpx.Client, body: Any) -> None:
    _post(http, "/cache/lookup", body)


@FUZZ
@given(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/cache/lookup", "/cache/clear"]),
    st.binary(max_size=200) | st.text(max_size=50).map(str.encode),
    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_raw_bodies(http: httpx.Client, path: str, raw: bytes, ctype: str) -> None:
    r = http.post(path, content=raw, headers={"Content-Type": ctype} if ctype else {})
    _check(r, path, raw)


@FUZZ
@given(
    st.sampled_from(["/v1/models", "/health", "/metrics", "/cache/stats", "/v1/completions"]),
    st.dictionaries(st.sampled_from(["integrity", "x", ""]), st.text(max_size=10), max_size=3),
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
)
def test_methods_and_queries(http: httpx.Client, path: str, query: dict, method: str) -> None:
    r = http.request(method, path, params=query)
    if path == "/metrics" and r.status_code == 200:
        assert r.text.startswith("#") or "asynchicache" in r.text
        return
    _check(r, path, (method, query))


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the JSON parser's recursion
        b'{"prompt": ' * 50_000 + b'"x"' + b"}" * 50_000,
        b'{"prompt": "' + b"word " * 400_000 + b'"}',  # 2 MB of prompt text
        b'{"prompt": [' + b"1," * 300_000 + b"1]}",  # 300k token ids
        b'{"prompt": "hi", "max_tokens": 1e400}',
        b'{"prompt": "hi", "seed": 123456789012345678901234567890}',
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "\\ud800"}',
        b"",
    ],
    ids=[
        "deep-list",
        "deep-dict",
        "2MB-text",
        "300k-ids",
        "1e400",
        "huge-seed",
        "bad-utf8",
        "lone-surrogate",
        "empty",
    ],
)
def test_hostile_bodies(http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/cache/lookup"):
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        _check(r, path, raw[:80])


def test_nan_is_not_a_number_we_accept(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        content=_encode({"prompt": "hi", "temperature": math.nan, "max_tokens": 2}),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text


def test_server_survived(server: LiveServer, http: httpx.Client) -> None:
    """Runs last: same processes, healthy, a normal request still answered, cache intact."""
    assert http.get("/health").status_code == 200
    assert server.pids() == server.first_pids  # type: ignore[attr-defined]
    r = http.post(
        "/v1/completions", json={"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert server.stats(integrity=True)["integrity"]["ok"]
    log = Path(server.log_path).read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 200 :][:3000]
