"""The cache admin routes: what an operator (and a router) asks of the cache.

    GET  /cache/stats     counters per tier, queues, pins
    POST /cache/lookup    tokens of a prompt each tier holds (device, host, disk, remote)
    POST /cache/clear     empty tiers (scope), one tenant's pages (cache_salt) or all
    POST /cache/pin       keep a prompt's pages in L2 and L3 (computed first if missing)
    POST /cache/unpin     drop pins

The engine does the work (engine/admin.py); an op it refuses answers with the
status its code names: "bad_request" 400, "over_limit" 409 (a pin past
--max-pinned-fraction), "unavailable" 503.

`?integrity=true` runs a full `check_integrity()` of the cache on the engine's
thread (a walk of every node, page and slot): only the admin may ask (403
otherwise), at most once per `INTEGRITY_INTERVAL_S` (429 with `Retry-After`).

Tenants: no answer names a salt (a pin's tenant is its `owner`, a keyed
fingerprint), and the list of pins with their owners goes to the admin only
(server/guards/auth.py); others see the counts. A lookup reads one namespace, the shared
one or the `cache_salt` the caller sends: the salt is the tenant's secret, and
nothing lists salts, so a caller learns only what its own requests could.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from asynchicache.engine.protocol import GenerateRequest, SamplingParams
from asynchicache.server.context import AppContext
from asynchicache.server.engine_client import EngineUnavailable
from asynchicache.server.errors import APIError, error_body
from asynchicache.server.guards.auth import is_admin
from asynchicache.server.openai.requests import chat_prompt_ids
from asynchicache.server.openai.schemas import (
    ChatCompletionRequest,
    ClearRequest,
    LookupRequest,
    PinRequest,
    UnpinRequest,
)

STATS_TIMEOUT_S = 5.0
INTEGRITY_INTERVAL_S = 1.0  # full integrity scans, server-wide
# /cache/stats and /metrics: how long they wait for the service's counters (the worst case of
# the synchronous calls on the engine's thread this replaced: 0.5 s stats + 1.0 s pins).
FRESH_STATS_WAIT_S = 1.5
FRESH_STATS_POLL_S = 0.05  # each poll is a full stats payload on the engine's thread
CLEAR_TIMEOUT_S = 90.0  # the cache service deletes files and Redis keys meanwhile
PIN_TIMEOUT_S = 30.0
_STATUS_BY_CODE = {"bad_request": 400, "over_limit": 409, "unavailable": 503}


async def admin(
    ctx: AppContext, op: str, timeout_s: float = STATS_TIMEOUT_S, **kwargs: Any
) -> dict[str, Any]:
    """An admin call's payload; its failure as the HTTP error its code names."""
    try:
        reply = await ctx.client.admin(op, timeout_s=timeout_s, **kwargs)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from exc
    if not reply.ok:
        code = reply.payload.get("code")
        status = _STATUS_BY_CODE.get(code or "", 500)
        message = reply.error if status != 500 else f"cache {op} failed: {reply.error}"
        kind = "invalid_request_error" if 400 <= status < 500 else None
        raise APIError(status, message or "failed", code=code, type_=kind)
    return reply.payload


async def fresh_stats(ctx: AppContext, wait_s: float = FRESH_STATS_WAIT_S) -> dict[str, Any]:
    """The engine's stats with the cache service's counters from after this call began.

    The engine answers from a snapshot, never a round trip to the service on its thread
    (a stopped service would hold every step); a snapshot older than this call makes it
    ask for the next one, which a later step brings in. So this asks again, awaiting on
    the event loop, until the snapshot is newer or `wait_s` passed (then it is what it
    is: `storage.at_monotonic_s` and `pins.at_monotonic_s` say when they were taken)."""
    start = time.monotonic()
    payload = await admin(ctx, "stats")
    while time.monotonic() - start < wait_s and _older_than(payload, start):
        await asyncio.sleep(FRESH_STATS_POLL_S)
        payload = await admin(ctx, "stats")
    return payload


def _older_than(payload: dict[str, Any], start: float) -> bool:
    """Whether the service's counters or pins in `payload` were taken before `start`
    (absent: no cache service)."""
    for part in ("storage", "pins"):
        section = payload.get(part)
        at = section.get("at_monotonic_s") if isinstance(section, dict) else None
        if at is not None and at < start:
            return True
    return False


def prompt_ids(ctx: AppContext, body: LookupRequest) -> list[int]:
    """The token ids of a body's `prompt` (text or ids) or `messages` (chat template), at
    most the context length (the length checked before the ids, the text's bytes before
    it is tokenized: server/guards/bounded_tokenizer.py)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        ids = chat_prompt_ids(ctx, ChatCompletionRequest(messages=body.messages))
    elif isinstance(body.prompt, str):
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=False)
    else:
        ids = list(body.prompt or [])
    _check_length(ctx, len(ids))
    if any(not 0 <= t < ctx.model.vocab_size for t in ids):
        raise APIError(400, "a token id is outside the vocabulary", param="prompt")
    return ids


async def prompt_ids_off_loop(ctx: AppContext, body: LookupRequest) -> list[int]:
    """`prompt_ids` in a worker thread: tokenizing a long prompt must not hold up others."""
    return await asyncio.to_thread(prompt_ids, ctx, body)


def _check_length(ctx: AppContext, n: int) -> None:
    if n > ctx.model.max_model_len:
        raise APIError(400, f"the prompt has {n} tokens; this model's context is "
                       f"{ctx.model.max_model_len}", param="prompt",
                       code="context_length_exceeded")  # fmt: skip


async def _compute(ctx: AppContext, ids: list[int], salt: str) -> None:
    """Prefill a prompt (one greedy token) so that its pages exist to be pinned."""
    if len(ids) >= ctx.model.max_model_len:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is "
                       f"{ctx.model.max_model_len}", param="prompt")  # fmt: skip
    req = GenerateRequest(f"pin-{uuid.uuid4().hex}", tuple(ids),
                          SamplingParams(max_tokens=1, temperature=0.0), salt)  # fmt: skip
    try:
        async for out in ctx.client.generate(req):
            if out.finish_reason == "error":
                raise APIError(500, f"computing the prompt failed: {out.error}")
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from exc


class Spacing:
    """At most one event per `interval_s`: `wait_s(now)` is 0 (and the event counts) or
    the seconds until the next may happen; `done(now)` restarts the interval when the
    event ends (a scan that took long is still followed by a quiet second)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: float | None = None

    def wait_s(self, now: float) -> float:
        if self._last is not None and now - self._last < self.interval_s:
            return self.interval_s - (now - self._last)
        self._last = now
        return 0.0

    def done(self, now: float) -> None:
        self._last = now


def _integrity_refused(request: Request, scans: Spacing) -> JSONResponse | None:
    """Why this caller may not run an integrity scan now (403, 429), or None."""
    if not is_admin(request):
        return APIError(403, "?integrity=true is for the admin key", param="integrity",
                        code="admin_only").response()  # fmt: skip
    wait = scans.wait_s(time.monotonic())
    if wait <= 0:
        return None
    body = error_body(f"an integrity scan ran less than {INTEGRITY_INTERVAL_S:g} s ago",
                      "rate_limit_error", "integrity", "rate_limited")  # fmt: skip
    return JSONResponse(body, 429, headers={"Retry-After": str(max(1, math.ceil(wait)))})


def add_cache_routes(app: FastAPI, ctx: AppContext) -> None:
    scans = Spacing(INTEGRITY_INTERVAL_S)

    @app.get("/cache/stats", response_model=None)
    async def cache_stats(
        request: Request, integrity: bool = False, traces: bool = False
    ) -> dict[str, Any] | JSONResponse:
        refused = _integrity_refused(request, scans) if integrity else None
        if refused is not None:
            return refused
        payload = await fresh_stats(ctx)
        pins = payload.get("pins")
        if isinstance(pins, dict) and not is_admin(request):
            payload["pins"] = {k: v for k, v in pins.items() if k != "pinned"}  # counts only
        if integrity:  # ?integrity=true: also run the cache's check_integrity() (soak, tests)
            try:
                payload["integrity"] = await admin(ctx, "integrity")
            finally:
                scans.done(time.monotonic())
        if traces and is_admin(request):  # ?traces=true: every kept request trace (benches)
            payload["traces"] = (await admin(ctx, "traces"))["traces"]
        return payload

    @app.post("/cache/lookup")
    async def cache_lookup(body: LookupRequest) -> dict[str, Any]:
        ids = await prompt_ids_off_loop(ctx, body)
        payload = await admin(ctx, "lookup", token_ids=tuple(ids), cache_salt=body.cache_salt or "")
        return {"prompt_tokens": len(ids), "cached_tokens_by_tier": payload}

    @app.post("/cache/clear")
    async def cache_clear(body: ClearRequest | None = None) -> dict[str, Any]:
        body = body or ClearRequest()
        return await admin(ctx, "clear", timeout_s=CLEAR_TIMEOUT_S, tiers=body.tiers,
                           cache_salt=body.cache_salt or "",
                           include_pinned=body.include_pinned)  # fmt: skip

    @app.post("/cache/pin")
    async def cache_pin(body: PinRequest) -> dict[str, Any]:
        ids = await prompt_ids_off_loop(ctx, body)
        salt = body.cache_salt or ""
        full = len(ids) // ctx.model.page_size * ctx.model.page_size
        if full == 0:
            raise APIError(400, f"the prompt has {len(ids)} tokens: a pin needs at least one "
                           f"full page of {ctx.model.page_size}", param="prompt")  # fmt: skip
        cached = await admin(ctx, "lookup", token_ids=tuple(ids), cache_salt=salt)
        computed = sum(cached.values()) < full
        if computed:
            await _compute(ctx, ids, salt)
        payload = await admin(ctx, "pin", timeout_s=PIN_TIMEOUT_S, token_ids=tuple(ids),
                              cache_salt=salt, ttl_s=body.ttl_s)  # fmt: skip
        return {**payload, "computed": computed}

    @app.post("/cache/unpin")
    async def cache_unpin(body: UnpinRequest) -> dict[str, Any]:
        pin_ids = tuple(body.pin_ids or ()) + ((body.pin_id,) if body.pin_id else ())
        ids: list[int] = []
        if not pin_ids:
            ids = await prompt_ids_off_loop(ctx, body)
        elif body.prompt is not None or body.messages is not None:
            raise APIError(400, "send pin ids or a prompt, not both", param="pin_id")
        return await admin(ctx, "unpin", timeout_s=PIN_TIMEOUT_S, token_ids=tuple(ids),
                           cache_salt=body.cache_salt or "", pin_ids=pin_ids)  # fmt: skip
