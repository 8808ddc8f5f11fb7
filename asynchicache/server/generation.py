"""One request's life in the HTTP process: engine tokens in, text deltas and a finish out.

Shared by `/v1/completions` and `/v1/chat/completions`, which differ only in
how they frame the events. Stop strings are applied here on the decoded text;
when one hits, the request is aborted in the engine and finishes with "stop".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from asynchicache.engine.protocol import CachedTokens, GenerateRequest, TokenOutput
from asynchicache.server.context import AppContext
from asynchicache.server.metrics import RequestMetrics
from asynchicache.server.stop import StopChecker


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    """The end of a generation, with what `usage` reports."""

    reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached: CachedTokens
    error: str | None = None


class _Timing:
    """TTFT, inter-token and end-to-end latency of one request."""

    def __init__(self, metrics: RequestMetrics) -> None:
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._start)
        else:
            # Tokens that arrive together share the gap since the previous batch.
            gap = (now - self._last) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
        self._last = now

    def done(self) -> None:
        self._metrics.e2e.observe(time.perf_counter() - self._start)


async def generate_text(
    ctx: AppContext, req: GenerateRequest, endpoint: str
) -> AsyncIterator[TextDelta | Finished]:
    """Yield text deltas, then exactly one `Finished` (unless the consumer leaves early)."""
    timing = _Timing(ctx.metrics.requests)
    # Special tokens (end of sequence) are skipped: they end the text, they are not in it.
    detok = ctx.tokenizer.incremental_decoder()
    stops = StopChecker(req.sampling.stop)
    produced = 0
    finish: Finished | None = None
    ctx.metrics.requests.in_flight.inc()
    stream = ctx.client.generate(req)
    try:
        async for out in stream:
            timing.tokens(len(out.token_ids))
            produced += len(out.token_ids)
            text = stops.push(detok.push(out.token_ids))
            if out.finished:
                text += stops.push(detok.flush())
                text += stops.flush()
            if text:
                yield TextDelta(text)
            if stops.stopped:
                final = (None if out.finished else await ctx.client.abort(req.rid)) or out
                finish = _finish(req, final, produced, "stop")
                break
            if out.finished:
                finish = _finish(req, out, produced, out.finish_reason or "stop")
                break
    finally:
        await stream.aclose()
        ctx.metrics.requests.in_flight.dec()
    if finish is None:  # the engine stream ended without a finished output
        finish = Finished("error", len(req.prompt_token_ids), produced, CachedTokens(), "no end")
    timing.done()
    ctx.metrics.requests.finished(
        endpoint, finish.reason, finish.prompt_tokens, finish.completion_tokens, finish.cached
    )
    yield finish


def _finish(req: GenerateRequest, out: TokenOutput, produced: int, reason: str) -> Finished:
    return Finished(
        reason=reason,
        prompt_tokens=out.prompt_tokens or len(req.prompt_token_ids),
        # After a stop string the engine may have counted tokens we never showed.
        completion_tokens=produced,
        cached=out.cached,
        error=out.error,
    )
