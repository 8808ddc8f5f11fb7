"""The FastAPI app: OpenAI-compatible endpoints, health, metrics and cache admin.

    POST /v1/completions          POST /v1/chat/completions      GET /v1/models
    GET  /health (liveness)       GET  /ready (readiness)        GET /metrics
    GET  /cache/stats             POST /cache/lookup             POST /cache/clear
    POST /cache/pin               POST /cache/unpin              (server/cache_admin.py)
    POST /tokenize, /detokenize   GET /version                   (vLLM's, server/compat_routes.py)
    POST /flush_cache, /clear_hicache_storage_backend             (SGLang's, admin)
    POST /v1/completions/render, /v1/chat/completions/render      (vLLM's, openai/render_routes.py)

Keys: server/guards/auth.py (every endpoint but `/health` and `/ready` wants the API key;
the admin key opens the cache admin routes and everything else). Before the keys,
server/guards/exposure.py refuses cross-site and rebound browser requests; after them,
server/guards/admission.py gives each work request its turn (or a 429).
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from asynchicache.server.cache_admin import add_cache_routes, fresh_stats
from asynchicache.server.compat_routes import add_compat_routes
from asynchicache.server.context import AppContext
from asynchicache.server.engine_client import EngineUnavailable
from asynchicache.server.errors import APIError, install_error_handlers
from asynchicache.server.guards.admission import Admission, AdmissionMiddleware
from asynchicache.server.guards.auth import ADMIN_PATHS, PUBLIC_PATHS, APIKeyMiddleware
from asynchicache.server.guards.exposure import ExposureGuard
from asynchicache.server.openai import completions
from asynchicache.server.openai.render_routes import add_render_routes
from asynchicache.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from asynchicache.server.readiness import readiness
from asynchicache.settings.config import ServerConfig

__all__ = ["ADMIN_PATHS", "PUBLIC_PATHS", "APIKeyMiddleware", "create_app"]

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0
# /health answers without asking the engine when it was heard from this recently.
HEARD_RECENTLY_S = 1.0


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
        # The engine sent something (a token, an answer) moments ago: it lives, and a busy
        # engine answers an admin call only between steps (issue 39: /health waited
        # behind every step of a loaded engine). Otherwise it is asked.
        quiet_s = time.monotonic() - ctx.client.last_heard
        if ctx.client.down is None and quiet_s < HEARD_RECENTLY_S:
            return JSONResponse({"status": "ok"})
        try:
            reply = await ctx.client.admin("health", timeout_s=STATS_TIMEOUT_S)
        except EngineUnavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        status = 200 if reply.ok else 503
        return JSONResponse({"status": "ok" if reply.ok else "unhealthy"}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            payload = await fresh_stats(ctx)
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
    add_render_routes(app, ctx)


def create_app(ctx: AppContext, server: ServerConfig | None = None) -> FastAPI:
    """The app for one engine; the launcher runs it under uvicorn. `server`: where it
    listens and its limits (None: the defaults)."""
    server = server or ServerConfig()
    app = FastAPI(title="asynchicache", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    _routes(app, ctx)
    keyed = ctx.api_key is not None or ctx.admin_api_key is not None
    # The last added runs first: where a request comes from, then its key, then its turn
    # (so a request without the key never holds a place in the queue).
    admission = Admission(server.max_concurrent_requests, server.max_waiting_requests)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    if keyed:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.api_key, admin_api_key=ctx.admin_api_key)
    app.add_middleware(ExposureGuard, listen_host=server.host, keyed=keyed)
    return app
