"""`/v1/completions` and `/v1/chat/completions`: validate, tokenize, generate, frame.

Everything a client can get wrong is checked here, before the engine sees the
request, and answered with a 400/404 in OpenAI's error shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from asynchicache.engine.protocol import GenerateRequest, SamplingParams
from asynchicache.server import sse
from asynchicache.server.context import AppContext
from asynchicache.server.disconnect import (
    ClientDisconnected,
    EventStreamResponse,
    run_until_disconnect,
)
from asynchicache.server.engine_client import EngineUnavailable
from asynchicache.server.errors import APIError, error_body
from asynchicache.server.generation import Finished, TextDelta, generate_text
from asynchicache.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)

# OpenAI's default for the legacy completions endpoint; chat defaults to the
# rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# ------------------------------------------------------------------ validation
def check_model(ctx: AppContext, model: str | None) -> None:
    if model is not None and model != ctx.model.name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{ctx.model.name}`.",
            param="model",
            code="model_not_found",
        )


def _check_supported(body: SamplingFields) -> None:
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if body.best_of not in (None, 1):
        raise APIError(400, "only best_of=1 is supported", param="best_of")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")


def _check_ids(ctx: AppContext, ids: list[int]) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    bad = next((t for t in ids if not 0 <= t < ctx.model.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} is outside the vocabulary (0..{ctx.model.vocab_size - 1})",
            param="prompt",
        )


def _max_tokens(
    ctx: AppContext, prompt_len: int, requested: int | None, default: int | None
) -> int:
    """The completion budget; a prompt or budget beyond the context is the client's error."""
    limit = ctx.model.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens. Please shorten the prompt.",
            param="messages" if default is None else "prompt",
            code="context_length_exceeded",
        )
    room = limit - prompt_len
    if requested is None:
        return min(default, room) if default is not None else room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


# Below this, logits / temperature overflows to inf: such a request is greedy (as in vLLM).
MIN_TEMPERATURE = 1e-5


def _sampling(body: SamplingFields, max_tokens: int) -> SamplingParams:
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
    )


def _completion_ids(ctx: AppContext, body: CompletionRequest) -> list[int]:
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400, "send one prompt per request (batches are not supported)", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.tokenizer.encode(prompt, add_special_tokens=False)
    return [int(t) for t in prompt]  # type: ignore[union-attr]


def _chat_ids(ctx: AppContext, body: ChatCompletionRequest) -> list[int]:
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # a template raising on an odd conversation is the input's fault
        raise APIError(
            400, f"the chat template rejected these messages: {exc}", param="messages"
        ) from exc
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def _salt(body: SamplingFields) -> str:
    return body.cache_salt or ""


def build_completion(ctx: AppContext, body: CompletionRequest) -> GenerateRequest:
    check_model(ctx, body.model)
    _check_supported(body)
    ids = _completion_ids(ctx, body)
    _check_ids(ctx, ids)
    max_tokens = _max_tokens(ctx, len(ids), body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    rid = f"cmpl-{uuid.uuid4().hex}"
    return GenerateRequest(rid, tuple(ids), _sampling(body, max_tokens), _salt(body))


def build_chat(ctx: AppContext, body: ChatCompletionRequest) -> GenerateRequest:
    check_model(ctx, body.model)
    _check_supported(body)
    ids = _chat_ids(ctx, body)
    _check_ids(ctx, ids)
    max_tokens = _max_tokens(ctx, len(ids), body.token_limit, None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return GenerateRequest(rid, tuple(ids), _sampling(body, max_tokens), _salt(body))


# -------------------------------------------------------------------- framing
def usage_of(f: Finished) -> Usage:
    by_tier = {
        "device": f.cached.device,
        "host": f.cached.host,
        "disk": f.cached.disk,
        "remote": f.cached.remote,
    }
    return Usage(
        prompt_tokens=f.prompt_tokens,
        completion_tokens=f.completion_tokens,
        total_tokens=f.prompt_tokens + f.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=f.cached.total, cached_tokens_by_tier=by_tier
        ),
    )


def _raise_for(f: Finished) -> None:
    if f.reason == "error":
        raise APIError(
            500, f"generation failed: {f.error or 'unknown error'}", type_="server_error"
        )


async def _collect(ctx: AppContext, req: GenerateRequest, endpoint: str) -> tuple[str, Finished]:
    parts: list[str] = []
    finish: Finished | None = None
    async for event in generate_text(ctx, req, endpoint):
        if isinstance(event, TextDelta):
            parts.append(event.text)
        else:
            finish = event
    assert finish is not None, "generate_text always ends with Finished"
    return "".join(parts), finish


async def _run_collect(
    ctx: AppContext, request: Request, req: GenerateRequest, endpoint: str
) -> tuple[str, Finished]:
    try:
        return await run_until_disconnect(request.receive, _collect(ctx, req, endpoint))
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from exc
    except ClientDisconnected as exc:
        # Nobody reads this answer; 499 (nginx's "client closed request") marks it in logs.
        raise APIError(499, "the client closed the connection") from exc


def _stream_error(exc: Exception) -> bytes:
    return sse.event(error_body(str(exc), "server_error", code="engine_unavailable"))


async def _completion_events(
    ctx: AppContext, req: GenerateRequest, include_usage: bool
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(text: str, reason: str | None) -> bytes:
        choice = CompletionChoice(text=text, finish_reason=reason)
        return sse.event(
            CompletionResponse(id=req.rid, created=created, model=ctx.model.name, choices=[choice])
        )

    try:
        async for event in generate_text(ctx, req, "completions"):
            if isinstance(event, TextDelta):
                yield chunk(event.text, None)
                continue
            if event.reason == "error":
                yield sse.event(error_body(event.error or "generation failed", "server_error"))
                break
            yield chunk("", event.reason)
            if include_usage:
                yield sse.event(
                    CompletionResponse(
                        id=req.rid,
                        created=created,
                        model=ctx.model.name,
                        choices=[],
                        usage=usage_of(event),
                    )
                )
    except EngineUnavailable as exc:
        yield _stream_error(exc)
    yield sse.DONE


async def _chat_events(
    ctx: AppContext, req: GenerateRequest, include_usage: bool
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: ChatDelta, reason: str | None) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=reason)
        return sse.event(
            ChatCompletionChunk(id=req.rid, created=created, model=ctx.model.name, choices=[choice])
        )

    yield chunk(ChatDelta(role="assistant", content=""), None)
    try:
        async for event in generate_text(ctx, req, "chat"):
            if isinstance(event, TextDelta):
                yield chunk(ChatDelta(content=event.text), None)
                continue
            if event.reason == "error":
                yield sse.event(error_body(event.error or "generation failed", "server_error"))
                break
            yield chunk(ChatDelta(), event.reason)
            if include_usage:
                yield sse.event(
                    ChatCompletionChunk(
                        id=req.rid,
                        created=created,
                        model=ctx.model.name,
                        choices=[],
                        usage=usage_of(event),
                    )
                )
    except EngineUnavailable as exc:
        yield _stream_error(exc)
    yield sse.DONE


# ------------------------------------------------------------------ endpoints
def _stream(events: AsyncIterator[bytes]) -> Response:
    return EventStreamResponse(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


async def completions(ctx: AppContext, request: Request, body: CompletionRequest) -> Response:
    req = build_completion(ctx, body)
    if body.stream:
        return _stream(_completion_events(ctx, req, body.include_usage))
    text, finish = await _run_collect(ctx, request, req, "completions")
    _raise_for(finish)
    resp = CompletionResponse(
        id=req.rid,
        model=ctx.model.name,
        choices=[CompletionChoice(text=text, finish_reason=finish.reason)],
        usage=usage_of(finish),
    )
    return JSONResponse(resp.model_dump())


async def chat_completions(
    ctx: AppContext, request: Request, body: ChatCompletionRequest
) -> Response:
    req = build_chat(ctx, body)
    if body.stream:
        return _stream(_chat_events(ctx, req, body.include_usage))
    text, finish = await _run_collect(ctx, request, req, "chat")
    _raise_for(finish)
    resp = ChatCompletionResponse(
        id=req.rid,
        model=ctx.model.name,
        choices=[
            ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish.reason)
        ],
        usage=usage_of(finish),
    )
    return JSONResponse(resp.model_dump())
