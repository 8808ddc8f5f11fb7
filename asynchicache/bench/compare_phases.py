"""What `bench compare` measures on one running server: TTFTs and client-count throughput.

Both kinds of request are streamed chat completions, greedy, `ignore_eos`, so
every server decodes the same number of tokens:

- `ttft`: one request with a long chat prompt, alone on the server; the time
  until the first content chunk arrives.
- `throughput`: N clients, each sending its requests one after the other
  (`--requests-per-client`), short prompts of mixed length behind one shared
  system prompt; completion tokens per second over the whole phase, and the
  TTFT distribution. The CPU time every process of the server used in the
  phase is recorded by role, with the client's own (the HTTP process's share
  is the cost of tokenizing, detokenizing and streaming).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from asynchicache.bench.clients.client import (
    ClientConfig,
    exact_chat_body,
    run_workload,
    stream_chat,
)
from asynchicache.bench.processes.peers import SERVED_NAME
from asynchicache.bench.processes.procwatch import cpu_by_role
from asynchicache.bench.reports.summary import summarize
from asynchicache.bench.workloads import text
from asynchicache.bench.workloads.workloads import Message, RequestSpec, Session, Workload


def long_prompt(seed: int, approx_tokens: int) -> list[Message]:
    """A document chat prompt of about `approx_tokens` tokens; `seed` makes it unique."""
    rng = random.Random(seed)
    doc = text.text(rng, approx_tokens - 40)
    question = text.question(rng, 30)
    return [
        {"role": "system", "content": f"Notes {seed}: answer from the document."},
        {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {question}"},
    ]


def short_prompt(seed: int) -> list[Message]:
    """A one-line question, for warming a server up (its first forward is slow)."""
    return [{"role": "user", "content": f"Say hello to visitor number {seed}."}]


@dataclass(frozen=True)
class Ttft:
    seconds: float
    prompt_tokens: int
    cached_tokens: int


async def _ttft(url: str, messages: list[Message], max_tokens: int) -> Ttft:
    body = exact_chat_body(messages, max_tokens, model=SERVED_NAME)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        t0 = time.perf_counter()
        stream = await stream_chat(client, body, t0)
    usage = stream.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    first = stream.first_s if stream.first_s is not None else time.perf_counter() - t0
    return Ttft(first, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0))


def ttft(url: str, messages: list[Message], max_tokens: int = 4) -> Ttft:
    """Time to the first content token of one streamed request."""
    return asyncio.run(_ttft(url, messages, max_tokens))


def clients_workload(clients: int, per_client: int, max_tokens: int, seed: int) -> Workload:
    """`clients * per_client` single-turn requests with 16-256-token questions behind a
    shared ~60-token system prompt, all due at once (the client count caps concurrency)."""
    rng = random.Random(seed)
    system = f"You are the help desk of harbour office {seed}. " + text.paragraph(rng, 50)
    n = clients * per_client
    sessions = tuple(
        Session(system, "", (text.question(rng, rng.randint(16, 256)),), chat=False)
        for _ in range(n)
    )
    requests = tuple(RequestSpec(i, 0, 0.0) for i in range(n))
    return Workload(
        f"clients-{clients}",
        sessions,
        requests,
        max_tokens,
        {"clients": clients, "requests_per_client": per_client},
    )


def throughput(url: str, root_pid: int, workload: Workload, clients: int) -> dict[str, Any]:
    """Play `workload` with at most `clients` requests in flight; rates, TTFTs and CPU."""
    cpu_before, client_before = cpu_by_role(root_pid), time.process_time()
    load = os.getloadavg()[0]
    cfg = ClientConfig(url, model=SERVED_NAME, max_concurrency=clients, progress=False)
    run = run_workload(workload, cfg)
    cpu_after, client_cpu = cpu_by_role(root_pid), time.process_time() - client_before
    s = summarize(run.results, run.duration_s)
    cpu = {role: round(cpu_after[role] - cpu_before.get(role, 0.0), 3) for role in cpu_after}
    per_token = {
        role: round(sec / s.completion_tokens * 1e3, 3) if s.completion_tokens else None
        for role, sec in {**cpu, "client": client_cpu}.items()
    }
    return {
        "tok_s": s.output_tokens_per_s,
        "mean_ttft_s": s.ttft.mean,
        "p50_ttft_s": s.ttft.p50,
        "p99_ttft_s": s.ttft.p99,
        "requests": s.requests,
        "errors": s.errors,
        "duration_s": s.duration_s,
        "completion_tokens": s.completion_tokens,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "cpu_s_by_process": {**cpu, "client": round(client_cpu, 3)},
        "cpu_ms_per_completion_token": per_token,
        "load_avg_1m": round(load, 2),
    }
