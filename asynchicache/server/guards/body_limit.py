"""`BodyLimitMiddleware`: `--max-request-bytes`, enforced before the body is read.

A body announced larger than the limit (`Content-Length`) is answered 413 at once,
unread; a body sent without a length (chunked) is counted as it arrives and answered
413 as soon as it passes the limit (the app sees an HTTP error from `receive`, and
FastAPI never parses a byte of it). The limit bounds what one request can make the
HTTP process hold: the body, its JSON and the prompt built from it; after a big body
the freed heap goes back to the system (heap_trim.py). Plain ASGI, so streamed
answers pass untouched.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asynchicache.server.errors import APIError
from asynchicache.server.guards.heap_trim import HeapTrim

STATUS = 413


def too_large(limit: int) -> str:
    return f"the request body is larger than this server takes ({limit} bytes, --max-request-bytes)"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.heap_trim = HeapTrim()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = _content_length(scope)
        if announced is not None and announced > self.max_bytes:
            await APIError(STATUS, too_large(self.max_bytes)).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # FastAPI re-raises an HTTPException as is
                    raise HTTPException(STATUS, too_large(self.max_bytes))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            # A big body's JSON, text and token lists are garbage now; glibc keeps
            # their pages unless asked (heap_trim.py).
            await self.heap_trim.after(max(seen, announced or 0))


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses such a request before it gets here
    return None
