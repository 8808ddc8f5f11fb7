"""`bench vllm`'s decode arm: clients decoding together, in tokens per second.

`clients` clients each send one streamed chat request at once (a short prompt of
their own that the server has never seen, greedy, `ignore_eos`, exactly
`max_tokens` tokens); the rate is every completion token (as the server counts
them in `usage`) over the wall time from the first request sent to the last
answer. Run against vLLM alone and vLLM with our connector, it prices the
connector on a decode-heavy load: every page a request fills while decoding is
copied into L2 after its step, then stored by the cache service.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from asynchicache.bench.clients.client import exact_chat_body, stream_chat
from asynchicache.bench.workloads.text import text


@dataclass(frozen=True)
class DecodeLoad:
    """The decode arm's load: `clients` requests of `max_tokens` tokens at once."""

    clients: int = 8
    max_tokens: int = 256
    prompt_tokens: int = 64  # each client's own short prompt (about)

    def __post_init__(self) -> None:
        if self.clients <= 0 or self.max_tokens <= 0 or self.prompt_tokens <= 0:
            raise ValueError(
                "--decode-clients, --decode-tokens and the prompt length must be positive"
            )

    def prompts(self, seed: int) -> list[list[dict[str, str]]]:
        """One chat per client, distinct from every other seed's (nothing is a cache hit)."""
        rng = random.Random(seed)
        return [
            [{"role": "user", "content": f"{text(rng, self.prompt_tokens)}\n\nContinue the text."}]
            for _ in range(self.clients)
        ]


def decode_tok_s(url: str, load: DecodeLoad, seed: int, model: str = "model") -> float:
    """Completion tokens per second of `load.clients` clients decoding together at `url`."""
    return asyncio.run(_decode(url, load, seed, model))


async def _decode(url: str, load: DecodeLoad, seed: int, model: str) -> float:
    bodies = [exact_chat_body(m, load.max_tokens, model=model) for m in load.prompts(seed)]
    limits = httpx.Limits(max_connections=load.clients)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_chat(client, body, start) for body in bodies))
        seconds = time.perf_counter() - start
    tokens = sum(int((s.usage or {}).get("completion_tokens", 0)) for s in streams)
    return tokens / seconds
