"""The FastAPI app: OpenAI-compatible endpoints, health, metrics and cache admin.

    POST /v1/completions          POST /v1/chat/completions      GET /v1/models
    GET  /health (liveness)       GET  /ready (readiness)        GET /metrics
    GET  /cache/stats             POST /cache/lookup             POST /cache/clear
    POST /cache/pin               POST /cache/unpin              (server/cache_admin.py)
    POST /tokenize, /detokenize   GET /version                   (vLLM's, server/compat_routes.py)
    GET|POST /flush_cache, /clear_hicache_storage_backend         (SGLang's, admin)

With an API key configured, every endpoint but `/health` and `/ready` wants
`Authorization: Bearer <key>`. With an admin key configured, the routes that
drop or pin cache contents (`ADMIN_PATHS`) want that key instead.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from asynchicache.server import completions
from asynchicache.server.cache_admin import add_cache_routes, admin
from asynchicache.server.compat_routes import ADMIN_COMPAT_PATHS, add_compat_routes
from asynchicache.server.context import AppContext
from asynchicache.server.engine_client import EngineUnavailable
from asynchicache.server.errors import APIError, install_error_handlers
from asynchicache.server.readiness import readiness
from asynchicache.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/ready"})
ADMIN_PATHS = frozenset({"/cache/clear", "/cache/pin", "/cache/unpin"}) | ADMIN_COMPAT_PATHS
STATS_TIMEOUT_S = 5.0


class APIKeyMiddleware:
    """Rejects requests without the right bearer token (plain ASGI: streams pass untouched).

    `api_key` guards every path but `PUBLIC_PATHS`; `admin_api_key`, when set,
    replaces it on `ADMIN_PATHS` (clearing or pinning the cache is an
    operator's act, not a client's). None: that key is not required.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key is not None else None
        self._admin_key = admin_api_key.encode() if admin_api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        admin = scope["path"] in ADMIN_PATHS and self._admin_key is not None
        wanted = self._admin_key if admin else self._key
        if wanted is None or _bearer_matches(scope, wanted):
            await self.app(scope, receive, send)
            return
        what = "admin API key" if admin else "API key"
        err = APIError(
            401,
            f"Incorrect or missing {what}; send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
        await err.response()(scope, receive, send)


def _bearer_matches(scope: Scope, key: bytes) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
    return False


def _routes(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.completions(ctx, request, body)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await completions.chat_completions(ctx, request, body)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        card = ModelCard(id=ctx.model.name, created=ctx.model.created, root=ctx.model.name,
                         max_model_len=ctx.model.max_model_len)  # fmt: skip
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        try:
            reply = await ctx.client.admin("health", timeout_s=STATS_TIMEOUT_S)
        except EngineUnavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        status = 200 if reply.ok else 503
        return JSONResponse({"status": "ok" if reply.ok else "unhealthy"}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            payload = await admin(ctx, "stats")
        except APIError as exc:
            log.warning("metrics scrape without engine stats: %s", exc.message)
            payload = None
        return Response(ctx.metrics.render(payload), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ready")
    async def ready() -> Response:
        ok, body = await readiness(ctx)
        return JSONResponse(body, status_code=200 if ok else 503)

    add_cache_routes(app, ctx)
    add_compat_routes(app, ctx)


def create_app(ctx: AppContext) -> FastAPI:
    """The app for one engine; the launcher runs it under uvicorn."""
    app = FastAPI(title="asynchicache", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    ctx.metrics.bind_model(ctx.model.name, ctx.model.page_size)  # vLLM's model_name label
    _routes(app, ctx)
    if ctx.api_key is not None or ctx.admin_api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.api_key, admin_api_key=ctx.admin_api_key)
    return app
