"""A scripted OpenAI-style streaming server on a real socket, recording what it received.

It answers `/v1/chat/completions` and `/v1/completions` (stream only; a
completion's prompt is token ids, its usage counts them) after `first_delay_s` with
`tokens` chunks `gap_s` apart, then a usage chunk whose per-tier cached counts
are read from the request (`cached` = 16 x the number of assistant messages,
reported as L1 for even turns and L3 for odd ones). A user message containing
FAIL gets an HTTP 500. `GET /v1/models` names `model_name` (a peer's readiness check).
Run as a script it is a `bench compare` peer: `python bench_helpers.py --port N`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass(frozen=True)
class Call:
    """One request as the server saw it (monotonic seconds)."""

    received: float
    finished: float
    body: dict


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class ScriptedServer:
    def __init__(
        self,
        first_delay_s: float = 0.05,
        gap_s: float = 0.01,
        tokens: int = 3,
        port: int = 0,
        model_name: str = "scripted",
    ):
        self.first_delay_s = first_delay_s
        self.gap_s = gap_s
        self.tokens = tokens
        self.model_name = model_name
        self.calls: list[Call] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning"))
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await request.json()
            received = time.monotonic()
            if any("FAIL" in m["content"] for m in body["messages"] if m["role"] == "user"):
                self.calls.append(Call(received, time.monotonic(), body))
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
            return StreamingResponse(self._stream(body, received), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            stream = self._completion(body, time.monotonic())
            return StreamingResponse(stream, media_type="text/event-stream")

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}

        return app

    async def _stream(self, body: dict, received: float) -> AsyncIterator[bytes]:
        yield _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(self.first_delay_s)
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.gap_s)
            yield _event({"choices": [{"delta": {"content": f" t{turn}.{i}"}}]})
        cached = 16 * turn
        tiers = {
            "device": cached if turn % 2 == 0 else 0,
            "host": 0,
            "disk": cached if turn % 2 else 0,
            "remote": 0,
        }
        words = sum(len(m["content"].split()) for m in body["messages"])
        usage = {
            "prompt_tokens": words,
            "completion_tokens": self.tokens,
            "prompt_tokens_details": {"cached_tokens": cached, "cached_tokens_by_tier": tiers},
        }
        # Recorded before the last bytes go out, so it precedes the client seeing the end.
        self.calls.append(Call(received, time.monotonic(), body))
        yield _event({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    async def _completion(self, body: dict, received: float) -> AsyncIterator[bytes]:
        await asyncio.sleep(self.first_delay_s)
        for i in range(body.get("max_tokens") or self.tokens):
            if i:
                await asyncio.sleep(self.gap_s)
            yield _event({"choices": [{"index": 0, "text": f" t{i}"}]})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.calls.append(Call(received, time.monotonic(), body))
        yield _event({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def serve_forever(self) -> None:
        """Serve on this thread until `close()` (or SIGTERM when run as a script)."""
        self._server.run(sockets=[self.sock])

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/missing", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("scripted server did not start")

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self.sock.close()


def main() -> None:
    """Serve until SIGTERM on `--port`, as `bench compare` starts a peer."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="scripted")
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--first-delay-s", type=float, default=0.05)
    p.add_argument("--gap-s", type=float, default=0.01)
    args, _ = p.parse_known_args()  # a peer's {model} and {disk} are not needed
    server = ScriptedServer(
        args.first_delay_s, args.gap_s, args.tokens, args.port, args.served_model_name
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
