"""Other servers' endpoints that clients and tools call: vLLM's and SGLang's.

    POST /tokenize          vLLM's shapes: {prompt | messages, add_special_tokens,
                            return_token_strs} -> {count, max_model_len, tokens, token_strs}
    POST /detokenize        vLLM's shapes: {tokens} -> {prompt}
    GET  /version           vLLM's shape: {"version": asynchicache's version}
    POST /flush_cache       SGLang's: empty L1 and L2 (admin key); text answer
    POST /clear_hicache_storage_backend
                            SGLang's: empty L3 and L4 (admin key); text answer

vLLM's `bench serve` calls /tokenize and /detokenize to line its prompts up with
the server's tokenizer. Both take at most the context length (more is a 400,
context_length_exceeded) and do their work off the event loop: the body is parsed,
tokenized and decoded in a worker thread, and a /detokenize body longer than the
context's ids could be is refused before it is parsed (issue 39: a 1,000,000-id
/detokenize held every other request for 0.45 s). The two SGLang routes change
state, so they are POST only (a GET from a link or an <img> must not empty a cache)
and among server/guards/auth.py's ADMIN_PATHS. `ENDPOINTS` is the table docs/migrating.md
is generated from.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asynchicache import __version__
from asynchicache.server.cache_admin import CLEAR_TIMEOUT_S, admin
from asynchicache.server.context import AppContext
from asynchicache.server.errors import APIError
from asynchicache.server.openai.requests import check_model
from asynchicache.server.openai.schemas import ChatMessage, Text

# A detokenize body (and a token list on its way back) is bounded like a prompt.
MAX_TOKENS = 1 << 20
# Bytes a /detokenize body may spend per id of the context (digits, a comma and the
# whitespace of pretty-printed JSON), and on everything else (the model's name).
DETOKENIZE_BYTES_PER_ID = 16
DETOKENIZE_SLACK_BYTES = 64 * 1024
FLUSHED = (
    "Cache flushed.\nL1 and L2 are empty but for pages running requests use (they stay "
    "until those end); L3 and L4 are untouched (/clear_hicache_storage_backend).\n"
)


@dataclass(frozen=True)
class CompatEndpoint:
    """One endpoint of another server and what it is here."""

    peer: str
    route: str  # "POST /tokenize"
    ours: str


ENDPOINTS = (
    CompatEndpoint("vLLM", "POST /tokenize", "the same request and response shapes (prompt or "
                   "messages; add_special_tokens, add_generation_prompt, return_token_strs)"),
    CompatEndpoint("vLLM", "POST /detokenize", "the same shapes: {tokens} -> {prompt}"),
    CompatEndpoint("vLLM", "GET /version", "{\"version\": asynchicache's version}"),
    CompatEndpoint("vLLM", "GET /metrics", "vLLM's metric names next to ours (docs/operations.md)"),
    CompatEndpoint("vLLM", "GET /health", "the same: 200 once the engine answers"),
    CompatEndpoint("vLLM", "POST /reset_prefix_cache", "POST /flush_cache or /cache/clear"),
    CompatEndpoint("SGLang", "POST /flush_cache",
                   "empties L1 and L2 (admin key); pages that running requests use stay, "
                   "so it does not wait for an idle server; 200 with a text answer. POST "
                   "only: SGLang's GET is a 405 here (a state change a link could trigger)"),
    CompatEndpoint("SGLang", "POST /clear_hicache_storage_backend",
                   "empties L3 and L4 (admin key); 200 with a text answer; POST only"),
    CompatEndpoint("SGLang", "GET /health, GET /metrics", "the same paths"),
    CompatEndpoint("LightLLM", "GET /health, GET /metrics", "the same paths"),
)  # fmt: skip


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest, in one body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: Text | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_TOKENS)


def _prompt_ids(ctx: AppContext, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return ctx.tokenizer.encode(body.prompt, add_special_tokens=special)
    if body.chat_template is not None:
        raise APIError(400, "a request's own chat_template is not supported; the model's "
                       "template applies", param="chat_template")  # fmt: skip
    if body.continue_final_message:
        raise APIError(400, "continue_final_message is not supported",
                       param="continue_final_message")  # fmt: skip
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages or ()]  # fmt: skip
    try:
        text = ctx.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
    except Exception as exc:  # a template raising on an odd conversation is the input's fault
        raise APIError(400, f"the chat template rejected these messages: {exc}",
                       param="messages") from exc  # fmt: skip
    return ctx.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


async def _clear(ctx: AppContext, tiers: tuple[str, ...], done: str) -> PlainTextResponse:
    try:
        await admin(ctx, "clear", timeout_s=CLEAR_TIMEOUT_S, tiers=tiers, cache_salt="",
                    include_pinned=False)  # fmt: skip
    except APIError as exc:
        return PlainTextResponse(f"{exc.message}\n", status_code=400)
    return PlainTextResponse(done)


Body = TypeVar("Body", bound=BaseModel)


def _too_long(ctx: AppContext, what: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {ctx.model.max_model_len} tokens; {what}",
        param="tokens" if "ids" in what else "prompt",
        code="context_length_exceeded",
    )


async def _read_body(request: Request, max_bytes: int | None, refusal: APIError) -> bytes:
    """The body, refused with `refusal` as soon as it passes `max_bytes` (None: no bound
    here; --max-request-bytes still holds)."""
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if max_bytes is not None and seen > max_bytes:
            raise refusal
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(model: type[Body], raw: bytes) -> Body:
    """`raw` validated as `model` in a worker thread, errors shaped as FastAPI's."""
    try:
        return await asyncio.to_thread(model.model_validate_json, raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _tokenized(ctx: AppContext, body: TokenizeRequest) -> dict[str, Any]:
    check_model(ctx, body.model)
    ids = _prompt_ids(ctx, body)
    if len(ids) > ctx.model.max_model_len:
        raise _too_long(ctx, f"this prompt has {len(ids)} tokens")
    strs = ctx.tokenizer.token_strs(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.model.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


def _detokenized(ctx: AppContext, body: DetokenizeRequest) -> dict[str, str]:
    check_model(ctx, body.model)
    if len(body.tokens) > ctx.model.max_model_len:
        raise _too_long(ctx, f"{len(body.tokens)} ids are more than it holds")
    if any(t >= ctx.model.vocab_size for t in body.tokens):
        raise APIError(400, "a token id is outside the vocabulary", param="tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def add_compat_routes(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await _read_body(request, None, _too_long(ctx, "the body is longer"))
        body = await _parse(TokenizeRequest, raw)
        return await asyncio.to_thread(_tokenized, ctx, body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        most = ctx.model.max_model_len * DETOKENIZE_BYTES_PER_ID + DETOKENIZE_SLACK_BYTES
        refusal = _too_long(ctx, f"a body of more than {most} bytes has more ids than it holds")
        body = await _parse(DetokenizeRequest, await _read_body(request, most, refusal))
        return await asyncio.to_thread(_detokenized, ctx, body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    # SGLang's `timeout` (wait for an idle server) is accepted: nothing here needs one.
    @app.post("/flush_cache")
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> PlainTextResponse:
        return await _clear(ctx, ("device", "host"), FLUSHED)

    @app.post("/clear_hicache_storage_backend")
    async def clear_storage() -> PlainTextResponse:
        return await _clear(ctx, ("disk", "remote"), "Hierarchical cache storage backend "
                            "cleared (L3 and L4).\n")  # fmt: skip
