"""uvicorn on a pre-bound socket, stopped by the launcher rather than by its own signals.

Connections are bounded in time: a request head must arrive whole within
`--header-timeout` of the connection opening (or of its last answer), and be at most
MAX_HEAD_BYTES; an idle keep-alive connection closes after KEEP_ALIVE_S.

Stopping is graceful: uvicorn stops accepting connections at once, new
generations on open connections are refused (503), and running ones get
`--shutdown-timeout` seconds to finish; then each still running ends with an
error (an error event and `[DONE]` on a stream, a JSON 503 otherwise). uvicorn
waits a little longer than that before it cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from asynchicache.server.api import create_app
from asynchicache.server.context import AppContext
from asynchicache.server.engine_client import EngineClient
from asynchicache.server.errors import JSONErrors
from asynchicache.server.guards.body_limit import BodyLimitMiddleware
from asynchicache.settings.config import ServerConfig

log = logging.getLogger(__name__)

GRACEFUL_HTTP_S = 5
KEEP_ALIVE_S = 5  # an idle connection's life after an answer (uvicorn's default, made explicit)
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers past this are a 400 (h11's default)
DRAIN_POLL_S = 0.05
SHUTTING_DOWN = "the server is shutting down"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP port before anything slow starts, so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
    # proto is IPPROTO_TCP, and with Nagle on every keep-alive response that goes out in
    # two writes waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(False)
    return sock


def head_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within `timeout_s` of opening or of its last answer (uvicorn itself waits forever for
    a head that trickles in: a few hundred such connections hold every file descriptor)."""

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._expire, self.cycle)

        def _expire(self, cycle: object) -> None:
            # Still the cycle of when the timer was armed, and no request of it running:
            # no new head arrived in time.
            waiting = self.cycle is None or self.cycle.response_complete
            if self.cycle is cycle and waiting and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the launcher decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class StopSignal:
    """Why the server is stopping (set once)."""

    event: asyncio.Event
    reason: str = ""
    exit_code: int = 0

    def set(self, reason: str, exit_code: int = 0) -> None:
        if not self.event.is_set():
            self.reason, self.exit_code = reason, exit_code
            self.event.set()


async def serve_http(
    ctx: AppContext, server: ServerConfig, sock: socket.socket, stop: StopSignal
) -> None:
    """Run uvicorn on `sock` until `stop` is set."""
    config = uvicorn.Config(
        JSONErrors(BodyLimitMiddleware(create_app(ctx, server), server.max_request_bytes)),
        log_level=server.log_level,
        timeout_graceful_shutdown=math.ceil(server.shutdown_timeout_s + GRACEFUL_HTTP_S),
        lifespan="off",
        access_log=server.log_level == "debug",
        http=head_timeout_protocol(server.header_timeout_s),
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    http = _Uvicorn(config)
    task = asyncio.create_task(http.serve(sockets=[sock]))
    waiter = asyncio.create_task(stop.event.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    http.should_exit = True
    waiter.cancel()
    await drain(ctx.client, server.shutdown_timeout_s)
    await task
    if not stop.event.is_set():
        stop.set("the HTTP server stopped", exit_code=1)


async def drain(client: EngineClient, timeout_s: float) -> None:
    """Refuse new generations, wait up to `timeout_s` for the running ones, then end
    those still running with an error."""
    client.refuse_new(SHUTTING_DOWN)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while client.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if client.in_flight:
        log.warning(
            "%d requests still running after --shutdown-timeout-s %.0fs; ending them",
            client.in_flight,
            timeout_s,
        )
        client.end_streams(SHUTTING_DOWN)
