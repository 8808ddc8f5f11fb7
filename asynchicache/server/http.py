"""uvicorn on a pre-bound socket, stopped by the launcher rather than by its own signals."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from asynchicache.config import ServerConfig
from asynchicache.server.api import create_app
from asynchicache.server.body_limit import BodyLimitMiddleware
from asynchicache.server.context import AppContext

GRACEFUL_HTTP_S = 5


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP port before anything slow starts, so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(False)
    return sock


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
        BodyLimitMiddleware(create_app(ctx), server.max_request_bytes),
        log_level=server.log_level,
        timeout_graceful_shutdown=GRACEFUL_HTTP_S,
        lifespan="off",
        access_log=server.log_level == "debug",
    )
    http = _Uvicorn(config)
    task = asyncio.create_task(http.serve(sockets=[sock]))
    waiter = asyncio.create_task(stop.event.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    http.should_exit = True
    waiter.cancel()
    await task
    if not stop.event.is_set():
        stop.set("the HTTP server stopped", exit_code=1)
