"""Issue 22, findings 4 and 8 (first half), on a live server (conftest.py).

* `--max-request-bytes` (8 MiB): a body announced larger is answered 413 at once, unread;
  one sent without a length is cut off with a 413 once it passes the limit;
* an 8 MiB prompt is refused (context length) without being tokenized, in well under a
  second; a prompt at the bound is tokenized off the event loop: /health keeps answering
  within 100 ms all the while;
* /cache/lookup takes at most the context length (1,000,000 token ids: a 400);
* the HTTP process's memory comes back within 20% of what it held before the big bodies.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from health_probe import HEALTH_MS, HealthProbe
from keyed_server import KEY, auth
from live_server import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MIB = 2**20
LIMIT = 8 * MIB


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as client:
        yield client


def _completion(http: httpx.Client, prompt: object) -> httpx.Response:
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    return http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})


def test_a_body_announced_too_large_is_refused_unread(http: httpx.Client) -> None:
    body = b'{"prompt": "' + b"a" * (50 * MIB) + b'"}'
    t = time.monotonic()
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:200]
    assert "--max-request-bytes" in r.json()["error"]["message"]
    assert time.monotonic() - t < 10


def test_a_chunked_body_is_cut_off_at_the_limit(http: httpx.Client) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(40):  # 40 MiB if it were all read
            sent += MIB
            yield b"a" * MIB
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["type"] == "invalid_request_error"


def _huge_prompts_probed(http: httpx.Client, url: str, max_len: int) -> tuple[float, list[float]]:
    """The three refusals under a /health probe: the 8 MiB one's seconds, the latencies."""
    with HealthProbe(url) as probe:
        t = time.monotonic()
        r = _completion(http, "word " * ((LIMIT - 4096) // 5))  # ~8 MiB of text
        huge_s = time.monotonic() - t
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # At the bound: short enough to be tokenized (~1 MB), then refused by its count.
        r = _completion(http, "The quick brown fox jumps over the lazy dog. " * 24_000)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = _completion(http, [1] * (max_len + 1))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(probe.latencies) >= 10
    return huge_s, probe.latencies


def test_huge_prompts_are_refused_without_stalling_health(
    http: httpx.Client, server: LiveServer
) -> None:
    """A stall (the event loop tokenizing or parsing) is there every time; a busy machine's
    scheduling delay (CI runs tests/vllm beside this suite) now and then: so up to three
    tries, and the bound must hold in one of them."""
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    tries = []
    for _ in range(3):
        huge_s, latencies = _huge_prompts_probed(http, server.url, max_len)
        assert huge_s < 2.0, f"an 8 MiB prompt took {huge_s:.1f}s to refuse"
        tries.append((max(latencies), statistics.median(latencies)))
        if max(latencies) < HEALTH_MS:
            return
    raise AssertionError(
        "/health slowest and median answers (ms) in each try: "
        + ", ".join(f"{worst:.0f} / {mid:.0f}" for worst, mid in tries)
    )


def test_lookup_is_bounded_by_the_context(http: httpx.Client) -> None:
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    t = time.monotonic()
    r = http.post("/cache/lookup", json={"prompt": [7] * 1_000_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t < 5
    ok = http.post("/cache/lookup", json={"prompt": [7] * max_len})
    assert ok.status_code == 200 and ok.json()["prompt_tokens"] == max_len


def test_memory_comes_back_after_big_bodies(http: httpx.Client, server: LiveServer) -> None:
    _completion(http, "warm up")  # the first request's lazy imports are not a leak
    time.sleep(0.5)
    before = _rss(server.pid)
    for _ in range(3):
        _completion(http, "word " * ((LIMIT - 4096) // 5))
        _completion(http, "The quick brown fox jumps over the lazy dog. " * 24_000)
        _completion(http, list(range(40_000)) * 30)
        http.post("/cache/lookup", json={"prompt": [7] * 1_000_000})
        http.post("/v1/completions", content=b"x" * (20 * MIB))
    time.sleep(1.0)
    after = _rss(server.pid)
    assert after <= before * 1.2, f"HTTP RSS {before / MIB:.0f} -> {after / MIB:.0f} MiB"
