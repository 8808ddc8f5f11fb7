"""`bench pressure`'s vLLM client (bench/clients/pressure_client.py) drives vLLM's own serving
benchmark code, `vllm.benchmarks.serve.benchmark`, against a scripted streaming server: the
call matches this vLLM's signature and every request is timed (the main suite tests the
httpx client of the same behaviour, and the bench end to end)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ports import free_port

from asynchicache.bench.clients.pressure_client import run

SCRIPTED = Path(__file__).parents[1] / "bench" / "bench_helpers.py"


@pytest.fixture
def scripted_url() -> Iterator[str]:
    port = free_port()
    # Chunks 0.1 s apart: a client delayed by the busy machine (tests/vllm runs beside
    # the main suite) still sees the stream's end well after its first chunk.
    flags = ["--port", str(port), "--first-delay-s", "0.05", "--gap-s", "0.1"]
    proc = subprocess.Popen([sys.executable, str(SCRIPTED), *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_vllms_client_times_every_request(scripted_url: str) -> None:
    prompts = [[1, 2, 3, i] for i in range(6)]
    result = run("vllm", prompts, scripted_url, concurrency=2, max_tokens=3)
    assert result.client == "vllm" and len(result.requests) == 6
    for r in result.requests:
        # The scripted server answers after 0.05 s with 3 chunks 0.1 s apart: the latency
        # runs to the stream's end (0.2 s after its first chunk, less any delay of ours
        # in reading that one).
        assert r.ok and r.prompt_tokens == 4 and r.output_tokens == 3
        assert 0.05 <= r.ttft < 5 and r.latency >= r.ttft + 0.1
    starts = sorted(r.start for r in result.requests)
    assert starts[2] > starts[0]  # two in flight at most: the third waited for one
