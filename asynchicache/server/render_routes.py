"""vLLM's render API: the token ids a request's prompt becomes here, for KV-aware routers.

    POST /v1/completions/render       a completion body -> [{"request_id", "token_ids"}, ...]
    POST /v1/chat/completions/render  a chat body       -> {"request_id", "token_ids"}

vllm-router's `kv_aware` policy (0.1.17) asks each worker's render endpoint for a
request's token ids, then matches them against the blocks the workers' KV events
announced (kv_events/wire.py). The ids come from the very functions that plan a
completion (server/requests.py), so the router sees what the engine will hash; nothing
is generated, and every field is checked as a completion's (same schema, same bounds).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI

from asynchicache.server.context import AppContext
from asynchicache.server.requests import (
    chat_prompt_ids,
    check_model,
    check_prompt_ids,
    completion_prompt_ids,
)
from asynchicache.server.schemas import ChatCompletionRequest, CompletionRequest


def add_render_routes(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        check_model(ctx, body.model)
        out = []
        for ids in completion_prompt_ids(ctx, body):
            check_prompt_ids(ctx, ids)
            out.append({"request_id": f"render-{uuid.uuid4().hex}", "token_ids": ids})
        return out

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        check_model(ctx, body.model)
        ids = chat_prompt_ids(ctx, body)
        check_prompt_ids(ctx, ids)
        return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": ids}
