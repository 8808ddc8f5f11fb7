"""One engine request's life in the HTTP process: token outputs in, text events out.

Shared by `/v1/completions` and `/v1/chat/completions`, which differ only in
how they frame the events. A request is a group of `n` members (samples of one
prompt); each member has its own detokenizer and stop strings. Stop strings are
applied here on the decoded text; when one hits, that member is aborted in the
engine and finishes with "stop" (tokens it produced after the stop are dropped).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from asynchicache.engine.protocol import CachedTokens, GenerateRequest, TokenLogprob, TokenOutput
from asynchicache.server.context import AppContext, IncrementalText
from asynchicache.server.engine_client import ABORT_GRACE_S
from asynchicache.server.metrics import RequestMetrics
from asynchicache.server.openai.stop import StopChecker, StopMatcher


@dataclass(frozen=True)
class TextDelta:
    """New text of member `index`, with the logprobs of the tokens behind it (if asked)."""

    text: str
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt tokens' logprobs (tokens 1..; the first has none), once per request."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    """The end of one member, with what `usage` reports."""

    reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached: CachedTokens
    error: str | None = None
    index: int = 0
    cumulative_logprob: float = 0.0


Event = TextDelta | PromptLogprobs | Finished


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


class _Member:
    """One sample's text state: detokenizer, stop strings, tokens shown so far."""

    def __init__(
        self, ctx: AppContext, req: GenerateRequest, index: int, stops: StopMatcher
    ) -> None:
        self.index = index
        self.prompt_tokens = len(req.prompt_token_ids)
        # Special tokens (end of sequence) are skipped: they end the text, they are not in it.
        self.detok: IncrementalText = ctx.tokenizer.incremental_decoder()
        self.stops = StopChecker(stops)
        self.produced = 0
        self.abort_sent = False
        self.finish: Finished | None = None

    def push(self, out: TokenOutput) -> TextDelta | None:
        if self.stops.stopped:
            return None  # tokens the engine made before our abort reached it
        self.produced += len(out.token_ids)
        text = self.stops.push(self.detok.push(out.token_ids))
        if out.finished:
            text += self.stops.push(self.detok.flush())
            text += self.stops.flush()
        if text or out.logprobs:
            return TextDelta(text, self.index, out.logprobs)
        return None

    def end(self, out: TokenOutput | None) -> Finished:
        if out is None:  # the engine's final output never came (see ABORT_GRACE_S)
            self.finish = Finished(
                "stop", self.prompt_tokens, self.produced, CachedTokens(), index=self.index
            )
            return self.finish
        reason = "stop" if self.stops.stopped else (out.finish_reason or "stop")
        self.finish = Finished(
            reason=reason,
            prompt_tokens=out.prompt_tokens or self.prompt_tokens,
            # After a stop string the engine may have counted tokens we never showed.
            completion_tokens=self.produced,
            cached=out.cached,
            error=out.error,
            index=self.index,
            cumulative_logprob=out.cumulative_logprob,
        )
        return self.finish


async def generate_text(
    ctx: AppContext, req: GenerateRequest, endpoint: str, stops: StopMatcher | None = None
) -> AsyncGenerator[Event, None]:
    """Yield text deltas per member, then one `Finished` per member (unless the consumer
    leaves early); prompt logprobs, when asked, come before the first delta. `stops`: the
    request's stop strings compiled off the event loop (None: compiled here)."""
    timing = _Timing(ctx.metrics.requests)
    matcher = StopMatcher(req.sampling.stop) if stops is None else stops
    members = [_Member(ctx, req, i, matcher) for i in range(req.n)]
    ctx.metrics.requests.in_flight.inc()
    stream = ctx.client.generate(req)
    try:
        while (out := await _next(stream, members)) is not None:
            if not 0 <= out.index < req.n or members[out.index].finish is not None:
                continue
            member = members[out.index]
            timing.tokens(len(out.token_ids))
            if out.prompt_logprobs:
                yield PromptLogprobs(out.prompt_logprobs)
            delta = member.push(out)
            if delta is not None:
                yield delta
            if out.finished or out.finish_reason == "error":
                yield member.end(out)
                if out.finish_reason == "error":
                    return
            elif member.stops.stopped and not member.abort_sent:
                member.abort_sent = True
                await ctx.client.abort(req.rid, None if req.n == 1 else out.index)
        for member in members:  # the engine went quiet after our aborts
            if member.finish is None:
                yield member.end(None)
    finally:
        await stream.aclose()
        ctx.metrics.requests.in_flight.dec()
        timing.done()
        _count(ctx, endpoint, members, req)


async def _next(stream: AsyncIterator[TokenOutput], members: list[_Member]) -> TokenOutput | None:
    """The next output; None at the end, or when every member still open was aborted
    after a stop string and the engine has not confirmed it within the grace period."""
    open_members = [m for m in members if m.finish is None]
    if not open_members:
        return None
    try:
        if all(m.abort_sent for m in open_members):
            async with asyncio.timeout(ABORT_GRACE_S):
                return await anext(stream)
        return await anext(stream)
    except (StopAsyncIteration, TimeoutError):
        return None


def _count(ctx: AppContext, endpoint: str, members: list[_Member], req: GenerateRequest) -> None:
    """One request in the metrics: its prompt (and cached tokens) once, every member's tokens."""
    ends = [m.finish for m in members if m.finish is not None]
    if not ends:
        return
    reasons = {f.reason for f in ends}
    reason = "error" if "error" in reasons else ends[0].reason
    completion = sum(f.completion_tokens for f in ends)
    ctx.metrics.requests.finished(
        endpoint, reason, ends[0].prompt_tokens, completion, ends[0].cached
    )


async def generate_many(
    ctx: AppContext,
    requests: tuple[GenerateRequest, ...],
    endpoint: str,
    stops: StopMatcher | None = None,
) -> AsyncGenerator[tuple[int, Event], None]:
    """The events of several requests (a list of prompts), as (request index, event),
    interleaved as they come. Leaving early cancels every request still running."""
    if len(requests) == 1:
        events = generate_text(ctx, requests[0], endpoint, stops)
        try:
            async for event in events:
                yield 0, event
        finally:
            await events.aclose()
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        events = generate_text(ctx, req, endpoint, stops)
        try:
            async for event in events:
                await queue.put((i, event))
            await queue.put((i, None))
        except Exception as exc:  # handed to the consumer, who raises it
            await queue.put((i, exc))
        finally:
            await events.aclose()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
