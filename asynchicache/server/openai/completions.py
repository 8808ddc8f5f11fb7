"""`/v1/completions` and `/v1/chat/completions`: plan, generate, frame.

`server/openai/requests.py` turns a body into engine requests (one per prompt, each a
group of `best_of` samples); this module runs them and frames the events as
OpenAI does: choice `i * n + j` is sample j of prompt i, streamed chunks carry
their choice's `index`, `usage` counts each prompt once and every sample's
tokens. With `best_of > n` (never streamed) the n samples with the highest
cumulative logprob are kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from asynchicache.common.tiers import TIERS
from asynchicache.engine.protocol import CachedTokens, TokenLogprob
from asynchicache.server.context import AppContext
from asynchicache.server.engine_client import EngineUnavailable, RequestTimedOut
from asynchicache.server.errors import APIError, error_body
from asynchicache.server.openai import sse
from asynchicache.server.openai.disconnect import (
    ClientDisconnected,
    EventStreamResponse,
    run_until_disconnect,
)
from asynchicache.server.openai.generation import (
    Event,
    Finished,
    PromptLogprobs,
    TextDelta,
    generate_many,
)
from asynchicache.server.openai.openai_logprobs import (
    CompletionLogprobsBuilder,
    TokenText,
    chat_logprobs,
    merge,
)
from asynchicache.server.openai.requests import Plan, plan_chat, plan_completion
from asynchicache.server.openai.schemas import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)


# -------------------------------------------------------------------- results
@dataclass
class Sample:
    """One member's whole answer (non-streaming)."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class PromptResult:
    """Every member of one prompt's request group, and the prompt's logprobs."""

    samples: list[Sample]
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def best(self, n: int) -> list[Sample]:
        """The n samples to answer with: all of them, or the n most likely for best_of."""
        if len(self.samples) == n:
            return self.samples
        ranked = sorted(
            self.samples,
            key=lambda s: s.finish.cumulative_logprob if s.finish else float("-inf"),
            reverse=True,
        )
        return ranked[:n]


@dataclass
class Tally:
    """What `usage` reports: each prompt once, every sample's tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: list[CachedTokens] = field(default_factory=list)
    counted: set[int] = field(default_factory=set)

    def add(self, prompt: int, f: Finished) -> None:
        self.completion_tokens += f.completion_tokens
        if prompt not in self.counted:
            self.counted.add(prompt)
            self.prompt_tokens += f.prompt_tokens
            self.cached.append(f.cached)

    def usage(self) -> Usage:
        by_tier = {tier: sum(getattr(c, tier) for c in self.cached) for tier in TIERS}
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(by_tier.values()), cached_tokens_by_tier=by_tier
            ),
        )


def _raise_for(f: Finished) -> None:
    if f.reason == "error":
        raise APIError(
            500, f"generation failed: {f.error or 'unknown error'}", type_="server_error"
        )


async def _collect(ctx: AppContext, plan: Plan, endpoint: str) -> tuple[list[PromptResult], Tally]:
    results = [PromptResult([Sample() for _ in range(r.n)]) for r in plan.requests]
    tally = Tally()
    events = generate_many(ctx, plan.requests, endpoint, plan.stops)
    try:
        async for i, event in events:
            if isinstance(event, PromptLogprobs):
                results[i].prompt_logprobs = event.entries
                continue
            sample = results[i].samples[event.index]
            if isinstance(event, TextDelta):
                sample.parts.append(event.text)
                sample.logprobs += event.logprobs
            else:
                _raise_for(event)
                sample.finish = event
                tally.add(i, event)
    finally:
        await events.aclose()
    return results, tally


async def _run_collect(
    ctx: AppContext, request: Request, plan: Plan, endpoint: str
) -> tuple[list[PromptResult], Tally]:
    try:
        return await run_until_disconnect(request.receive, _collect(ctx, plan, endpoint))
    except RequestTimedOut as exc:
        raise APIError(504, str(exc), code=exc.code, type_="timeout") from exc
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from exc
    except ClientDisconnected as exc:
        # Nobody reads this answer; 499 (nginx's "client closed request") marks it in logs.
        raise APIError(499, "the client closed the connection") from exc


def _reason(sample: Sample) -> str | None:
    return sample.finish.reason if sample.finish else None


# ---------------------------------------------------------------- completions
def _echo_text(ctx: AppContext, plan: Plan, i: int) -> str:
    return ctx.tokenizer.decode(plan.requests[i].prompt_token_ids) if plan.echo else ""


def _completion_logprobs(
    text: TokenText,
    plan: Plan,
    i: int,
    prompt_lps: tuple[TokenLogprob, ...],
    entries: list[TokenLogprob],
) -> CompletionLogprobs | None:
    if plan.logprobs is None:
        return None
    builder = CompletionLogprobsBuilder(text)
    pieces = [builder.prompt(plan.requests[i].prompt_token_ids, prompt_lps)] if plan.echo else []
    return merge([*pieces, builder.tokens(entries)])


async def completions(ctx: AppContext, request: Request, body: CompletionRequest) -> Response:
    plan = await asyncio.to_thread(plan_completion, ctx, body)  # tokenizes: off the loop
    if body.stream:
        return _stream(_completion_events(ctx, plan, body.include_usage))
    results, tally = await _run_collect(ctx, request, plan, "completions")
    text = TokenText(ctx.tokenizer)
    choices = []
    for i, result in enumerate(results):
        echo = _echo_text(ctx, plan, i)
        for j, sample in enumerate(result.best(plan.n)):
            logprobs = _completion_logprobs(text, plan, i, result.prompt_logprobs, sample.logprobs)
            choices.append(
                CompletionChoice(
                    index=i * plan.n + j,
                    text=echo + sample.text,
                    logprobs=logprobs,
                    finish_reason=_reason(sample),
                )
            )
    resp = CompletionResponse(
        id=plan.rid, model=ctx.model.name, choices=choices, usage=tally.usage()
    )
    return JSONResponse(resp.model_dump())


class _CompletionChunks:
    """Frames one streamed completions answer: echo first, then deltas, per choice."""

    def __init__(self, ctx: AppContext, plan: Plan) -> None:
        self.ctx, self.plan = ctx, plan
        self.created = int(time.time())
        self.text = TokenText(ctx.tokenizer)
        self.builders: dict[int, CompletionLogprobsBuilder] = {}
        self.prompt_lps: dict[int, tuple[TokenLogprob, ...]] = {}

    def chunk(
        self, index: int, text: str, reason: str | None, logprobs: CompletionLogprobs | None = None
    ) -> bytes:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)
        return sse.event(
            CompletionResponse(
                id=self.plan.rid, created=self.created, model=self.ctx.model.name, choices=[choice]
            )
        )

    def first(self, i: int, j: int) -> list[bytes]:
        """The echoed prompt, before choice (i, j)'s first text."""
        index = i * self.plan.n + j
        if index in self.builders:
            return []
        builder = self.builders[index] = CompletionLogprobsBuilder(self.text)
        if not self.plan.echo:
            return []
        logprobs = None
        if self.plan.logprobs is not None:
            ids = self.plan.requests[i].prompt_token_ids
            logprobs = builder.prompt(ids, self.prompt_lps.get(i, ()))
        return [self.chunk(index, _echo_text(self.ctx, self.plan, i), None, logprobs)]

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        index = i * self.plan.n + event.index
        out = self.first(i, event.index)
        logprobs = None
        if self.plan.logprobs is not None:
            logprobs = self.builders[index].tokens(event.logprobs)
        return [*out, self.chunk(index, event.text, None, logprobs)]


async def _completion_events(
    ctx: AppContext, plan: Plan, include_usage: bool
) -> AsyncIterator[bytes]:
    frames = _CompletionChunks(ctx, plan)

    def on_event(i: int, event: Event) -> list[bytes]:
        if isinstance(event, PromptLogprobs):
            frames.prompt_lps[i] = event.entries
            return []
        if isinstance(event, TextDelta):
            return frames.delta(i, event)
        end = frames.chunk(i * plan.n + event.index, "", event.reason)
        return [*frames.first(i, event.index), end]

    def usage_chunk(usage: Usage) -> CompletionResponse:
        return CompletionResponse(
            id=plan.rid, created=frames.created, model=ctx.model.name, choices=[], usage=usage
        )

    async for data in _event_stream(ctx, plan, "completions", on_event, usage_chunk, include_usage):
        yield data


# ----------------------------------------------------------------------- chat
def _chat_choice_logprobs(
    text: TokenText, plan: Plan, entries: list[TokenLogprob] | tuple[TokenLogprob, ...]
) -> ChatChoiceLogprobs | None:
    if plan.logprobs is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(text, entries))


async def chat_completions(
    ctx: AppContext, request: Request, body: ChatCompletionRequest
) -> Response:
    plan = await asyncio.to_thread(plan_chat, ctx, body)  # tokenizes: off the loop
    if body.stream:
        return _stream(_chat_events(ctx, plan, body.include_usage))
    results, tally = await _run_collect(ctx, request, plan, "chat")
    text = TokenText(ctx.tokenizer)
    choices = [
        ChatChoice(
            index=j,
            message=ChatResponseMessage(content=sample.text),
            logprobs=_chat_choice_logprobs(text, plan, sample.logprobs),
            finish_reason=_reason(sample),
        )
        for j, sample in enumerate(results[0].best(plan.n))
    ]
    resp = ChatCompletionResponse(
        id=plan.rid, model=ctx.model.name, choices=choices, usage=tally.usage()
    )
    return JSONResponse(resp.model_dump())


async def _chat_events(ctx: AppContext, plan: Plan, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    text = TokenText(ctx.tokenizer)

    def chunk(
        index: int, delta: ChatDelta, reason: str | None, logprobs: ChatChoiceLogprobs | None = None
    ) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
        return sse.event(
            ChatCompletionChunk(
                id=plan.rid, created=created, model=ctx.model.name, choices=[choice]
            )
        )

    def on_event(_: int, event: Event) -> list[bytes]:
        if isinstance(event, PromptLogprobs):
            return []
        if isinstance(event, TextDelta):
            logprobs = _chat_choice_logprobs(text, plan, event.logprobs)
            return [chunk(event.index, ChatDelta(content=event.text), None, logprobs)]
        return [chunk(event.index, ChatDelta(), event.reason)]

    def usage_chunk(usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=plan.rid, created=created, model=ctx.model.name, choices=[], usage=usage
        )

    for j in range(plan.n):
        yield chunk(j, ChatDelta(role="assistant", content=""), None)
    async for data in _event_stream(ctx, plan, "chat", on_event, usage_chunk, include_usage):
        yield data


# ------------------------------------------------------------------ streaming
async def _event_stream(
    ctx: AppContext,
    plan: Plan,
    endpoint: str,
    on_event: Callable[[int, Event], list[bytes]],
    usage_chunk: Callable[[Usage], BaseModel],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The plan's engine events as SSE frames (`on_event` makes them; a finish is tallied
    first), then the usage chunk when asked for, then [DONE]. A failed request or an
    engine gone away ends the stream early with an error event (no usage chunk)."""
    tally = Tally()
    events = generate_many(ctx, plan.requests, endpoint, plan.stops)
    try:
        async for i, event in events:
            if isinstance(event, Finished):
                if event.reason == "error":
                    yield sse.event(error_body(event.error or "generation failed", "server_error"))
                    break
                tally.add(i, event)
            for data in on_event(i, event):
                yield data
        else:
            if include_usage:
                yield sse.event(usage_chunk(tally.usage()))
    except EngineUnavailable as exc:
        yield _stream_error(exc)
    finally:
        await events.aclose()
    yield sse.DONE


def _stream_error(exc: Exception) -> bytes:
    code = exc.code if isinstance(exc, EngineUnavailable) else "engine_unavailable"
    return sse.event(error_body(str(exc), "server_error", code=code))


def _stream(events: AsyncIterator[bytes]) -> Response:
    return EventStreamResponse(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
