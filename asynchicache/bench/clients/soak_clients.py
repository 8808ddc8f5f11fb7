"""The soak's clients: prompts over a few long shared prefixes, streamed greedy requests
(some abandoned mid-stream on purpose), and the tally of what they saw."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from asynchicache.bench.soak_config import SoakConfig

_TOPICS = ("lighthouse keepers", "glacier surveys", "orchard ledgers", "ferry timetables")


@dataclass(frozen=True)
class SoakPrompt:
    """One request body's variable part: chat messages or a completion prompt."""

    key: str
    chat: bool
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""

    def body(self, max_tokens: int) -> dict[str, Any]:
        common = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        if self.chat:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages], **common}
        return {"prompt": self.prompt, **common}


def _system(topic: str, rng: random.Random, n_lines: int) -> str:
    lines = [
        f"Record {i}: the {topic} report {rng.randint(100, 999)} units on day {i}."
        for i in range(n_lines)
    ]
    return f"You answer questions about {topic}.\n" + "\n".join(lines)


def make_prompts(
    n: int, seed: int, prefix_lines: int = 40, prefixes: int = len(_TOPICS)
) -> list[SoakPrompt]:
    """`n` prompts over `prefixes` long shared prefixes: chat and completions, half each."""
    rng = random.Random(seed)
    topics = [f"{_TOPICS[i % len(_TOPICS)]} (series {i // len(_TOPICS)})" for i in range(prefixes)]
    systems = [_system(t, rng, prefix_lines) for t in topics]
    out = []
    for k in range(n):
        system = systems[k % len(systems)]
        question = f"Question {k}: what happened on day {rng.randint(0, prefix_lines - 1)}?"
        if k % 2 == 0:
            out.append(SoakPrompt(f"c{k}", True, (("system", system), ("user", question))))
        else:
            out.append(SoakPrompt(f"p{k}", False, prompt=f"{system}\n{question}\nAnswer:"))
    return out


@dataclass
class Tally:
    """What the clients saw (one per run; only the event loop thread touches it)."""

    started: int = 0
    completed: int = 0
    disconnects: int = 0
    completion_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    mismatches: int = 0
    mismatch_examples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(f"{kind}: {detail[:300]}")

    def answer(self, key: str, text: str) -> None:
        first = self.answers.setdefault(key, text)
        if first != text:
            self.mismatches += 1
            if len(self.mismatch_examples) < 10:
                self.mismatch_examples.append(f"{key}: {text!r} != {first!r}")


@dataclass
class _Stream:
    text: str = ""
    chunks: int = 0
    ttft: float | None = None
    done: bool = False
    tokens: int = 0


def _consume(line: str, s: _Stream, t0: float) -> str | None:
    """Fold one SSE line into `s`; an error text when the server sent one."""
    if not line.startswith("data: "):
        return None
    if line == "data: [DONE]":
        s.done = True
        return None
    chunk = json.loads(line[6:])
    if "error" in chunk:
        return str(chunk["error"])
    for choice in chunk.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if piece and s.ttft is None:
            s.ttft = time.perf_counter() - t0
        s.text += piece
    if chunk.get("usage"):
        s.tokens = chunk["usage"].get("completion_tokens", 0)
    s.chunks += 1
    return None


async def _request(
    http: httpx.AsyncClient, p: SoakPrompt, cfg: SoakConfig, cut_after: int | None, tally: Tally
) -> None:
    path = "/v1/chat/completions" if p.chat else "/v1/completions"
    t0 = time.perf_counter()
    s = _Stream()
    tally.started += 1
    try:
        async with http.stream("POST", path, json=p.body(cfg.max_tokens)) as r:
            if r.status_code != 200:
                tally.error(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
                return
            async for line in r.aiter_lines():
                problem = _consume(line, s, t0)
                if problem is not None:
                    tally.error("stream_error", problem)
                    return
                if s.done:
                    break
                if cut_after is not None and s.chunks >= cut_after:
                    tally.disconnects += 1  # leaving the block closes the connection
                    return
    except httpx.TimeoutException as exc:
        tally.error("timeout", repr(exc))
        return
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        tally.error(type(exc).__name__, repr(exc))
        return
    if not s.done:
        tally.error("truncated", f"{p.key}: stream ended without [DONE]")
        return
    tally.completed += 1
    tally.completion_tokens += s.tokens
    tally.e2e.append(time.perf_counter() - t0)
    if s.ttft is not None:
        tally.ttft.append(s.ttft)
    tally.answer(p.key, s.text)


async def client_loop(
    index: int, http: httpx.AsyncClient, cfg: SoakConfig, prompts: list[SoakPrompt],
    tally: Tally, deadline: float,
) -> None:  # fmt: skip
    rng = random.Random(cfg.seed * 1000 + index)
    while time.monotonic() < deadline:
        cut = rng.randint(1, 3) if rng.random() < cfg.disconnect_rate else None
        await _request(http, rng.choice(prompts), cfg, cut, tally)
