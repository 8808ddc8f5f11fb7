"""End to end: `python -m asynchicache serve` with the default SmolLM2 model, a real engine
process, a disk cache in a temporary folder, and the official `openai` client.

One server is shared by the module; the last test stops it with SIGTERM, checks
that nothing is left behind, restarts it on the same disk folder and expects
the long prompt to come back from disk with the same greedy answer.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from processes import children_of, pid_alive, proc_title
from serve_process import ServeProcess, disk_server
from settling import wait_until
from traffic import by_tier, inventory, timed_chat

from asynchicache.common.shm import list_segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("e2e")
    state: dict[str, object] = {"disk": root / "kv", "log": root / "server.log"}
    server = disk_server(root / "kv", root / "server.log")
    server.start()
    state["server"] = server
    try:
        yield state
    finally:
        for key in ("server", "restarted"):
            srv = state.get(key)
            if isinstance(srv, ServeProcess):
                srv.shutdown()


def _client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _metric(server: ServeProcess, line_prefix: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in /metrics")


def _wait_gone(pids: list[int]) -> None:
    """Until every pid exited (the server's exit does not wait for its orphans' reaping)."""
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), f"{pids} to exit", 30)


def test_capital_of_france(served: dict[str, object]) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess)
    resp = _client(server).chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in (resp.choices[0].message.content or "")
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_streaming_equals_non_streaming(served: dict[str, object]) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess)
    client = _client(server)
    args = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 12}
    full = client.completions.create(**args, temperature=0)
    parts = [
        c.choices[0].text
        for c in client.completions.create(**args, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(parts) == full.choices[0].text and full.choices[0].text


def test_repeated_long_prompt_is_served_from_the_cache(served: dict[str, object]) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess)
    hits_before = _metric(server, 'asynchicache_cache_hit_tokens_total{tier="device"}')
    cold_ttft, cold_text, cold_usage = timed_chat(server.url, inventory(0))
    warm_ttft, warm_text, warm_usage = timed_chat(server.url, inventory(0))
    assert cold_usage.prompt_tokens >= 1500  # type: ignore[attr-defined]
    assert warm_usage.prompt_tokens_details.cached_tokens >= 1400  # type: ignore[attr-defined]
    assert warm_text == cold_text
    hits_after = _metric(server, 'asynchicache_cache_hit_tokens_total{tier="device"}')
    assert hits_after - hits_before >= 1400
    assert _metric(server, "asynchicache_time_to_first_token_seconds_count") >= 2
    served["cold"] = (cold_ttft, cold_text)
    print(f"\ncold TTFT {cold_ttft:.3f}s, warm TTFT {warm_ttft:.3f}s, tiers {by_tier(warm_usage)}")


def test_cache_salt_separates_namespaces(served: dict[str, object]) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess)
    client = _client(server)
    prompt = "Salted prompt. " + " ".join(f"Line {i} of a private document." for i in range(20))

    def cached(salt: str) -> int:
        resp = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        return resp.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 128
    assert cached("tenant-b") == 0


@pytest.mark.parametrize(
    "body",
    [
        {"model": "SmolLM2-135M-Instruct", "prompt": "word " * 9000},
        {"model": "gpt-4", "prompt": "hi"},
        {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 0},
        {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 10**7},
        {"model": "SmolLM2-135M-Instruct", "prompt": [10**9]},
        {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user"}], "n": 33},
    ],
)
def test_bad_input_on_the_real_server(served: dict[str, object], body: dict[str, object]) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1e-30},
        {"temperature": 2.0, "top_p": 1e-9, "top_k": 10**6, "seed": 2**64 - 1},
        {"temperature": 0.7, "seed": -(2**63), "stop": ["", "\n\n"]},
    ],
)
def test_odd_but_valid_sampling_is_served(
    served: dict[str, object], extra: dict[str, object]
) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_sigterm_leaves_nothing_and_restart_serves_from_disk(served: dict[str, object]) -> None:
    server = served["server"]
    assert isinstance(server, ServeProcess) and "cold" in served
    disk = served["disk"]
    assert isinstance(disk, Path)
    children = server.child_pids
    titles = {proc_title(pid) for pid in children}
    assert "asynchicache: engine" in titles
    segments = [s for s in list_segments() if any(f"-{pid}-" in s for pid in children)]
    assert server.terminate() == 0
    _wait_gone(children)
    assert not set(segments) & set(list_segments())
    assert list(disk.rglob(".tmp-*")) == []

    restarted = disk_server(disk, Path(str(served["log"])))
    served["restarted"] = restarted
    restarted.start()
    cold_ttft, cold_text = served["cold"]  # type: ignore[misc]
    ttft, text, usage = timed_chat(restarted.url, inventory(0))
    tiers = by_tier(usage)
    print(f"\nafter restart: TTFT {ttft:.3f}s (cold {cold_ttft:.3f}s), tiers {tiers}")
    assert text == cold_text
    assert usage.prompt_tokens_details.cached_tokens >= 1400  # type: ignore[attr-defined]
    assert tiers["disk"] + tiers["remote"] >= 1400


def test_a_crashed_cache_service_is_restarted(served: dict[str, object]) -> None:
    server = served.get("restarted")
    assert isinstance(server, ServeProcess) and server.proc is not None
    disk = served["disk"]
    assert isinstance(disk, Path)
    (service,) = [p for p in server.child_pids if proc_title(p) == "asynchicache: cache-service"]
    os.kill(service, signal.SIGKILL)
    parent = server.proc.pid

    def replacement() -> list[int]:
        return [
            p
            for p in children_of(parent)
            if p != service and proc_title(p) == "asynchicache: cache-service"
        ]

    wait_until(replacement, "the cache service to be restarted", 30)
    messages = [{"role": "user", "content": "Name three colours of the rainbow. " * 20}]
    _, text, usage = timed_chat(server.url, messages)
    assert text and usage.prompt_tokens > 0  # type: ignore[attr-defined]


def test_a_dead_engine_is_replaced_and_stopping_leaves_nothing(
    served: dict[str, object],
) -> None:
    """kill -9 of the engine: a new one serves (its L2 segment removed once it is up);
    SIGTERM then stops everything and leaves no segment and no temp file."""
    server = served.get("restarted")
    assert isinstance(server, ServeProcess) and server.proc is not None
    disk = served["disk"]
    assert isinstance(disk, Path)
    parent = server.proc.pid
    (engine,) = [p for p in children_of(parent) if proc_title(p) == "asynchicache: engine"]
    segments = [s for s in list_segments() if f"-{engine}-" in s]
    assert segments, "the engine should own the L2 segment"
    os.kill(engine, signal.SIGKILL)  # no chance to unlink its segment

    def ready() -> bool:
        return httpx.get(server.url + "/ready", timeout=30).status_code == 200

    wait_until(lambda: not pid_alive(engine) and ready(), "a new engine to serve", 300)
    assert not set(segments) & set(list_segments())  # the dead engine's L2 pool is gone
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    _, text, _ = timed_chat(server.url, messages)
    assert text
    children = children_of(parent)
    assert server.terminate() == 0
    _wait_gone(children)
    assert not {s for s in list_segments() if any(f"-{p}-" in s for p in children)}
    assert list(disk.rglob(".tmp-*")) == []
