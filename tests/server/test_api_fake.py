"""The HTTP layer against a fake engine process (real sockets, real tokenizer, real client).

The fake engine echoes the prompt's tokens, so every expected text is known.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import SLOW_SEED
from server_helpers import API_KEY, FAKE_CONTEXT, ThreadServer

from asynchicache.launch.frontend import Frontend

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _client(server: ThreadServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _echo(frontend: Frontend, text: str, n: int) -> str:
    ids = frontend.tokenizer.encode(text)
    return frontend.tokenizer.decode(ids[:n])


def _aborts(run_dir: Path) -> list[str]:
    path = run_dir / "aborts.txt"
    return path.read_text().split() if path.exists() else []


def test_completion_non_streaming(server: ThreadServer, frontend: Frontend) -> None:
    resp = _client(server).completions.create(model="fake-model", prompt=PROMPT, max_tokens=5)
    assert resp.choices[0].text == _echo(frontend, PROMPT, 5)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    n_prompt = len(frontend.tokenizer.encode(PROMPT))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, 5)
    assert resp.usage.total_tokens == n_prompt + 5
    details = resp.usage.prompt_tokens_details
    assert details is not None
    by_tier = details.model_extra["cached_tokens_by_tier"]  # type: ignore[index]
    assert set(by_tier) == {"device", "host", "disk", "remote"}
    assert details.cached_tokens == sum(by_tier.values())


def test_completion_streaming_matches_and_carries_usage(
    server: ThreadServer, frontend: Frontend
) -> None:
    stream = _client(server).completions.create(
        model="fake-model",
        prompt=PROMPT,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _echo(frontend, PROMPT, 8)
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}


def test_every_raw_chunk_has_a_usage_key(server: ThreadServer) -> None:
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all("usage" in p and p["usage"] is None for p in payloads)


def test_chat_streaming_and_not(server: ThreadServer) -> None:
    client = _client(server)
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(
        model="fake-model", messages=messages, max_completion_tokens=12
    )
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model="fake-model",
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    )


def test_cached_tokens_grow_on_a_repeated_prefix(server: ThreadServer) -> None:
    client = _client(server)
    prompt = "A shared prefix that is long enough to fill a few pages of sixteen tokens. " * 4
    first = client.completions.create(model="fake-model", prompt=prompt + "One", max_tokens=2)
    second = client.completions.create(model="fake-model", prompt=prompt + "Two", max_tokens=2)
    assert first.usage and second.usage
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached >= 48 > first.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]


def test_stop_string_trims_and_aborts(server: ThreadServer, frontend: Frontend) -> None:
    resp = _client(server).completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=40, stop=["lazy", "never"]
    )
    assert resp.choices[0].text == "The quick brown fox jumps over the "
    assert resp.choices[0].finish_reason == "stop"
    assert resp.id in _aborts(server.run_dir)


def test_stop_string_streaming_holds_back_partial_matches(server: ThreadServer) -> None:
    stream = _client(server).completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=40, stop="fox jumps", stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == "The quick brown "
    assert not any("fox" in p for p in pieces)


def test_client_disconnect_aborts_the_request(server: ThreadServer) -> None:
    body = {
        "model": "fake-model",
        "prompt": PROMPT * 3,
        "max_tokens": 100,
        "stream": True,
        "seed": SLOW_SEED,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        first = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    rid = json.loads(first[6:])["id"]
    deadline = time.monotonic() + 5
    while rid not in _aborts(server.run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in _aborts(server.run_dir)


def test_non_streaming_disconnect_aborts_too(server: ThreadServer) -> None:
    body = {"model": "fake-model", "prompt": PROMPT * 3, "max_tokens": 100, "seed": SLOW_SEED}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    deadline = time.monotonic() + 5
    while len(_aborts(server.run_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(r.startswith("cmpl-") for r in _aborts(server.run_dir)[-1:])


def test_models_health_and_admin(server: ThreadServer) -> None:
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    stats = httpx.get(server.url + "/cache/stats", headers=AUTH).json()
    assert "cache" in stats and "queues" in stats
    lookup = httpx.post(server.url + "/cache/lookup", json={"prompt": PROMPT}, headers=AUTH).json()
    assert lookup["prompt_tokens"] > 0 and "device" in lookup["cached_tokens_by_tier"]
    chat_lookup = httpx.post(
        server.url + "/cache/lookup",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=AUTH,
    )
    assert chat_lookup.status_code == 200
    assert httpx.post(server.url + "/cache/clear", headers=AUTH).json()["cleared"] >= 0


def test_metrics_show_request_and_engine_counters(server: ThreadServer) -> None:
    _client(server).completions.create(model="fake-model", prompt=PROMPT, max_tokens=2)
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    expected = (
        "asynchicache_time_to_first_token_seconds_count",
        'asynchicache_cached_prompt_tokens_total{tier="device"}',
        "asynchicache_engine_up 1.0",
        'asynchicache_cache_hit_tokens_total{tier="device"}',
        'asynchicache_cache_transfer_bytes_total{kind="device_to_host"}',
        'asynchicache_cache_pages{state="free",tier="device"}',
        'asynchicache_cache_occupancy_ratio{tier="device"}',
        'asynchicache_scheduler_queue_length{queue="running"}',
        'asynchicache_cache_failures_total{kind="store"}',
        'asynchicache_cache_events_total{what="writes_skipped"}',
        "asynchicache_engine_cache_page_bytes 4096.0",
    )
    assert [sample for sample in expected if sample not in text] == []


# ------------------------------------------------------------------ bad input
BAD_BODIES = [
    ("/v1/completions", b"{not json", "invalid_json"),
    ("/v1/completions", {"model": "fake-model"}, None),  # no prompt
    ("/v1/completions", {"model": "fake-model", "prompt": 42}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": "many"}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 0}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "n": 0}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "n": 3, "best_of": 2}, None),
    (
        "/v1/completions",
        {"model": "fake-model", "prompt": "x", "best_of": 2, "stream": True},
        None,
    ),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logprobs": 21}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logprobs": True}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "suffix": "y"}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "presence_penalty": 3}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "repetition_penalty": 0}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logit_bias": {"x": 1}}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logit_bias": {"5": 101}}, None),
    (
        "/v1/completions",
        {"model": "fake-model", "prompt": "x", "logit_bias": {"99999999": 1}},
        None,
    ),
    ("/v1/completions", {"model": "fake-model", "prompt": ["a", ""]}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": []}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": -3}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "temperature": -1}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "top_p": 0}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "stream": "yes"}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "stop": 7}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "seed": 2**64}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "top_k": 2**40}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "top_k": -2}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": ""}, None),
    ("/v1/completions", {"model": "fake-model", "prompt": [1, 99999999]}, None),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, "model_not_found"),
    (
        "/v1/completions",
        {"model": "fake-model", "prompt": "word " * 400},
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"model": "fake-model", "prompt": "x", "max_tokens": 10**9},
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"model": "fake-model", "messages": []}, None),
    ("/v1/chat/completions", {"model": "fake-model", "messages": "hello"}, None),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "wizard"}]}, None),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"content": "hi"}]}, None),
    (
        "/v1/chat/completions",
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 0,
        },
        None,
    ),
    ("/v1/chat/completions", [1, 2, 3], None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2},
        None,
    ),
    ("/cache/lookup", {}, None),
]


@pytest.mark.parametrize(("path", "body", "code"), BAD_BODIES)
def test_bad_input_is_a_4xx_with_an_openai_error(
    server: ThreadServer, path: str, body: object, code: str | None
) -> None:
    if isinstance(body, bytes):
        headers = {**AUTH, "Content-Type": "application/json"}
        r = httpx.post(server.url + path, content=body, headers=headers)
    else:
        r = httpx.post(server.url + path, json=body, headers=AUTH)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("GET", "/cache/stats"),
        ("POST", "/cache/clear"),
        ("GET", "/nowhere"),
    ],
)
def test_api_key_is_enforced(
    server: ThreadServer, headers: dict[str, str], method: str, path: str
) -> None:
    r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_sees_errors_and_server_keeps_serving(server: ThreadServer) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert client.completions.create(model="fake-model", prompt="ok", max_tokens=1).choices


def test_unknown_route_is_an_openai_shaped_404(server: ThreadServer) -> None:
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_context_limit_is_the_fake_context(server: ThreadServer) -> None:
    r = httpx.get(server.url + "/v1/models", headers=AUTH)
    assert r.json()["data"][0]["max_model_len"] == FAKE_CONTEXT
