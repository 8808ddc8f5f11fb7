"""Client disconnects cancel the work done for them.

A request whose client went away must be aborted in the engine at once, or it
keeps its KV pages and its batch slot until `max_tokens`. Both helpers watch
the ASGI `receive` channel for `http.disconnect` (which the server delivers
once the body is read) and cancel the producer; the producer's `finally`
(`EngineClient.generate`) then sends the `AbortRequest`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; cancel it and raise `ClientDisconnected` if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """A streaming response that stops its producer as soon as the client leaves.

    Starlette only notices a disconnect when a send fails (ASGI spec >= 2.4),
    which can be long after the client left if no token is due; here a watcher
    task cancels the stream at once, and the body iterator is always closed.
    """

    body_iterator: AsyncIterator[bytes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            exc = stream.exception()
            if not isinstance(exc, OSError):  # OSError: the socket closed under a send
                raise exc  # type: ignore[misc]
