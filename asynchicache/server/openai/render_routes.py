"""vLLM's render API: the token ids a request's prompt becomes here, for KV-aware routers.

    POST /v1/completions/render       a completion body -> [{"request_id", "token_ids"}, ...]
    POST /v1/chat/completions/render  a chat body       -> {"request_id", "token_ids"}

vllm-router's `kv_aware` policy (0.1.17) asks each worker's render endpoint for a
request's token ids, then matches them against the blocks the workers' KV events
announced (kv_events/wire.py). The ids come from the very functions that plan a
completion (server/openai/requests.py), so the router sees what the engine will hash; nothing
is generated; the body is checked as a completion's (same schema), a prompt is bounded
by the context before it is tokenized, and tokenizing runs off the event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI

from asynchicache.server.context import AppContext
from asynchicache.server.errors import APIError
from asynchicache.server.openai.requests import chat_prompt_ids, check_model, completion_prompt_ids
from asynchicache.server.openai.schemas import ChatCompletionRequest, CompletionRequest


def add_render_routes(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        check_model(ctx, body.model)
        prompts = await asyncio.to_thread(completion_prompt_ids, ctx, body)
        return [_rendered(ids) for ids in prompts]

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        check_model(ctx, body.model)
        ids = await asyncio.to_thread(_chat, ctx, body)
        return _rendered(ids)


def _chat(ctx: AppContext, body: ChatCompletionRequest) -> list[int]:
    ids = chat_prompt_ids(ctx, body)
    if len(ids) > ctx.model.max_model_len:
        raise APIError(400, f"the prompt is longer than the context "
                       f"({ctx.model.max_model_len} tokens)", param="messages")  # fmt: skip
    return ids


def _rendered(ids: list[int]) -> dict[str, Any]:
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": ids}
