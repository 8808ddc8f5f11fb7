"""The client of `bench pressure`: one run of prompts at a fixed concurrency, per-request times.

    python -m asynchicache.bench.clients.pressure_client --requests IN.json --url URL
        --concurrency C --max-tokens N --client vllm|ours --out OUT.json

`vllm` (the default of `bench pressure`): vLLM's own serving benchmark client,
`vllm.benchmarks.serve.benchmark` (what `vllm bench serve` runs; its `vllm`
command line is broken in the CPU wheel, so it is called from Python), run
with the Python of a venv that has vLLM. Every arm, ours included, is timed
by that same code, so no arm gets a client of its own making. `ours`: an
httpx client of the same behaviour (streamed `/v1/completions`, TTFT at the
first chunk with a choice, `max_concurrency` requests in flight, all due at
once) for machines without vLLM and for the tests.

Both send token-id prompts, greedy (`temperature` 0), `ignore_eos`, and write
one JSON object: the run's duration and, per request in input order, its
start (`time.perf_counter()`, CLOCK_MONOTONIC on Linux: the engine's trace
timestamps are on the same clock), TTFT, end-to-end latency, completion
tokens and error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

CLIENTS = ("vllm", "ours")
SERVED_NAME = "smollm2"


@dataclass(frozen=True)
class RequestTiming:
    """One request as a client saw it."""

    start: float  # perf_counter() when sent
    ttft: float | None  # seconds to the first streamed choice
    latency: float | None  # seconds to the last
    prompt_tokens: int
    output_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None


@dataclass(frozen=True)
class ClientRun:
    client: str
    duration_s: float
    requests: tuple[RequestTiming, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "client": self.client,
            "duration_s": self.duration_s,
            "requests": [asdict(r) for r in self.requests],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ClientRun:
        reqs = tuple(RequestTiming(**r) for r in raw["requests"])
        return cls(str(raw["client"]), float(raw["duration_s"]), reqs)


# ------------------------------------------------------------------ vLLM's client
async def _vllm_run(
    prompts: Sequence[Sequence[int]], url: str, concurrency: int, max_tokens: int
) -> ClientRun:
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    samples = [
        SampleRequest(prompt=list(p), prompt_len=len(p), expected_output_len=max_tokens)
        for p in prompts
    ]
    result = await benchmark(
        task_type=TaskType.GENERATION,
        endpoint_type="openai",  # streamed /v1/completions
        api_url=f"{url}/v1/completions",
        base_url=url,
        model_id=SERVED_NAME,
        model_name=SERVED_NAME,
        tokenizer=None,  # output tokens from the usage chunk
        input_requests=samples,
        logprobs=None,
        request_rate=float("inf"),  # all due at once: the concurrency is the only limit
        burstiness=1.0,
        disable_tqdm=True,
        num_warmups=0,
        profile=False,
        selected_percentile_metrics=["ttft", "e2el"],
        selected_percentiles=[50.0, 90.0, 99.0],
        ignore_eos=True,
        goodput_config_dict={},
        max_concurrency=concurrency,
        lora_modules=None,
        extra_headers=None,
        extra_body={"temperature": 0.0},
        # Its ready check sends the first prompt once before the run: that would
        # cache a prefix of the run. The bench waits for readiness itself.
        ready_check_timeout_sec=0,
    )
    errors = result["errors"]
    timings = tuple(
        RequestTiming(
            start=result["start_times"][i],
            ttft=result["ttfts"][i] if not errors[i] else None,
            latency=result["latencies"][i] if not errors[i] else None,
            prompt_tokens=int(result["input_lens"][i]),
            output_tokens=int(result["output_lens"][i] or 0),
            error=errors[i] or None,
        )
        for i in range(len(prompts))
    )
    return ClientRun("vllm", float(result["duration"]), timings)


# ------------------------------------------------------------------- our client
async def _one(
    client: httpx.AsyncClient, prompt: Sequence[int] | str, max_tokens: int
) -> RequestTiming:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),  # text: bench fleet
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    output_tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return RequestTiming(start, None, None, len(prompt), 0, resp.text[:500])
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    last = time.perf_counter() - start
                    first = last if first is None else first
                elif chunk.get("usage"):
                    output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
    except httpx.HTTPError as exc:
        return RequestTiming(start, None, None, len(prompt), 0, f"{type(exc).__name__}: {exc}")
    error = None if first is not None else "no streamed choice"
    return RequestTiming(start, first, last, len(prompt), output_tokens, error)


async def _ours_run(
    prompts: Sequence[Sequence[int] | str], url: str, concurrency: int, max_tokens: int
) -> ClientRun:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600.0, limits=limits) as client:

        async def limited(prompt: Sequence[int] | str) -> RequestTiming:
            async with gate:
                return await _one(client, prompt, max_tokens)

        t0 = time.perf_counter()
        timings = await asyncio.gather(*(limited(p) for p in prompts))
    return ClientRun("ours", time.perf_counter() - t0, tuple(timings))


def run(
    client: str, prompts: Sequence[Sequence[int] | str], url: str, concurrency: int, max_tokens: int
) -> ClientRun:
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r}; known: {', '.join(CLIENTS)}")
    if client == "ours":  # text prompts too (bench fleet)
        return asyncio.run(_ours_run(prompts, url, concurrency, max_tokens))
    ids = [p for p in prompts if not isinstance(p, str)]
    if len(ids) != len(prompts):
        raise ValueError("the vllm client sends token ids only")
    return asyncio.run(_vllm_run(ids, url, concurrency, max_tokens))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="asynchicache.bench.clients.pressure_client", description=__doc__
    )
    p.add_argument("--requests", type=Path, required=True, help="JSON list of token-id prompts")
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--client", choices=CLIENTS, default="vllm")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    prompts = json.loads(a.requests.read_text())
    result = run(a.client, prompts, a.url, a.concurrency, a.max_tokens)
    a.out.write_text(json.dumps(result.to_json()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
