"""The HTTP process's asyncio ZeroMQ client to the engine process.

One PUSH socket carries requests to the engine, one PULL socket brings back
`StepOutputs` (every `TokenOutput` of an engine step in one message), single
`TokenOutput`s and `AdminReply`s; a single reader task routes each output to
the queue of its request id and each admin reply to the future of its call.
The engine binds both sockets; this side connects, so either may start first.

When the engine process dies, the launcher calls `engine_lost`: every request
in flight ends with `EngineUnavailable` (a JSON 503, or an error event and
`[DONE]` on a stream), new ones are refused until `engine_back`, and the
sockets are made anew so nothing queued for the dead engine reaches the next.
At shutdown, `refuse_new` turns new generations away while running ones finish.

Every generation carries a deadline (`request_timeout_s` from its start): past it,
it is aborted and ends with `RequestTimedOut` (a JSON 504, or an error event on a
stream), whatever the engine does. `ping` asks for "health" even while the client
is down: the launcher's watchdog (launch/engine_probe.py) pings through it, and
`last_heard` says when the engine last sent anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from asynchicache.engine.protocol import (
    AbortRequest,
    AdminReply,
    AdminRequest,
    GenerateRequest,
    StepOutputs,
    TokenOutput,
    decode,
    encode,
)

log = logging.getLogger(__name__)

# After an abort, how long to wait for the engine's final output (it carries the
# cached-token counts) before answering without it.
ABORT_GRACE_S = 2.0
HEALTH_RETRY_S = 0.05


def engine_input_addr(run_dir: Path) -> str:
    return f"ipc://{run_dir / 'engine-in'}"


def engine_output_addr(run_dir: Path) -> str:
    return f"ipc://{run_dir / 'engine-out'}"


class EngineUnavailable(RuntimeError):
    """The engine did not answer in time, or has gone away."""

    status = 503  # what the HTTP layer answers
    code = "engine_unavailable"


class RequestTimedOut(EngineUnavailable):
    """A generation ran past its deadline (--request-timeout); it was aborted."""

    status = 504
    code = "request_timeout"


class EngineClient:
    """Submit requests, stream their outputs, and make admin calls.

    Create and use it inside one running event loop; `start()` before use.
    """

    def __init__(
        self, input_addr: str, output_addr: str, request_timeout_s: float | None = None
    ) -> None:
        self._input_addr = input_addr
        self._output_addr = output_addr
        self._ctx = zmq.asyncio.Context()
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._streams: dict[str, asyncio.Queue[TokenOutput | EngineUnavailable]] = {}
        self._admin: dict[str, asyncio.Future[AdminReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._dead: str | None = None  # why nothing is served now (engine gone, closing)
        self._refusing: str | None = None  # why new generations are refused (shutting down)
        self._request_timeout_s = request_timeout_s  # None: no deadline
        self.last_heard = time.monotonic()  # when the engine last sent anything (or start)

    @classmethod
    def for_run_dir(cls, run_dir: Path, request_timeout_s: float | None = None) -> EngineClient:
        return cls(engine_input_addr(run_dir), engine_output_addr(run_dir), request_timeout_s)

    async def start(self) -> None:
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop a request or an abort
        self._push.connect(self._input_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.connect(self._output_addr)
        self._reader = asyncio.create_task(self._read_loop(), name="engine-reader")

    async def _stop_sockets(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._push = self._pull = None

    async def close(self) -> None:
        await self._stop_sockets()
        self.fail_all("the server is shutting down")
        self._ctx.term()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def down(self) -> str | None:
        """Why nothing is served now (the engine is gone or restarting); None when up."""
        return self._dead

    async def engine_lost(self, reason: str) -> None:
        """The engine process died: end what is in flight, refuse new work until
        `engine_back`, and drop whatever was queued for it (fresh sockets)."""
        self.fail_all(reason)
        await self._stop_sockets()
        await self.start()

    def engine_back(self) -> None:
        """A (new) engine answered its health check: serve again."""
        self._dead = None

    def refuse_new(self, reason: str) -> None:
        """Turn away new generations (shutdown); those running go on."""
        self._refusing = reason

    # ------------------------------------------------------------------ reader
    async def _read_loop(self) -> None:
        assert self._pull is not None
        while True:
            raw = await self._pull.recv()
            try:
                msg = decode(raw)
            except ValueError as exc:
                log.warning("dropping a malformed engine message: %s", exc)
                continue
            self.last_heard = time.monotonic()
            self._route(msg)

    def _route(self, msg: object) -> None:
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                self._route_output(out)
        elif isinstance(msg, TokenOutput):
            self._route_output(msg)
        elif isinstance(msg, AdminReply):
            fut = self._admin.pop(msg.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            log.warning("dropping an unexpected engine message %s", type(msg).__name__)

    def _route_output(self, out: TokenOutput) -> None:
        queue = self._streams.get(out.rid)
        if queue is not None:
            queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """End every open stream (its `generate` raises `EngineUnavailable`) and admin
        call with `reason`, and refuse new ones until `engine_back`."""
        self._dead = reason
        self.end_streams(reason)
        for fut in self._admin.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))
        self._admin.clear()

    def end_streams(self, reason: str) -> None:
        """End every open generation with `EngineUnavailable(reason)` (the engine may run
        on: the shutdown's deadline passed, or it is gone)."""
        for queue in list(self._streams.values()):
            queue.put_nowait(EngineUnavailable(reason))

    # -------------------------------------------------------------- generation
    async def _send(self, msg: object) -> None:
        if self._push is None:
            raise EngineUnavailable("the engine client is not started")
        await self._push.send(encode(msg))

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenOutput, None]:
        """Yield the engine's outputs for every member of `req` until each has finished.

        If the consumer stops early (client disconnected), the request is
        aborted so that the engine frees its pages.
        """
        refused = self._dead or self._refusing
        if refused is not None:
            raise EngineUnavailable(refused)
        timeout = self._request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        queue: asyncio.Queue[TokenOutput | EngineUnavailable] = asyncio.Queue()
        self._streams[req.rid] = queue
        open_members = set(range(req.n))
        try:
            await self._send(req)
            while open_members:
                out = await self._next(queue, deadline)
                if isinstance(out, EngineUnavailable):
                    raise out
                if out.finish_reason == "error":  # answers the whole request
                    open_members.discard(out.index)
                    yield out
                    return  # (the finally aborts the other members)
                if out.finished:
                    open_members.discard(out.index)
                yield out
        finally:
            if open_members and self._streams.get(req.rid) is queue:
                await self._abort_quietly(req.rid)
            if self._streams.get(req.rid) is queue:
                del self._streams[req.rid]

    async def _next(
        self, queue: asyncio.Queue[TokenOutput | EngineUnavailable], deadline: float | None
    ) -> TokenOutput | EngineUnavailable:
        """The stream's next item, or `RequestTimedOut` once its deadline passed."""
        try:
            async with asyncio.timeout_at(deadline):
                return await queue.get()
        except TimeoutError:
            return RequestTimedOut(
                f"the request did not finish within {self._request_timeout_s:g}s "
                "(--request-timeout-s); it was aborted"
            )

    async def abort(self, rid: str, index: int | None = None) -> None:
        """Ask the engine to end `rid` (one member, or all): its final outputs follow
        on the request's stream."""
        await self._send(AbortRequest(rid, index))

    async def _abort_quietly(self, rid: str) -> None:
        # Runs in a finally that may itself be unwinding a cancellation: shield the
        # send so the abort reaches the engine even then. With the engine gone there is
        # nothing to abort (and a send would wait for the next engine to connect).
        if self._dead is not None:
            return
        try:
            await asyncio.shield(self._send(AbortRequest(rid)))
        except (asyncio.CancelledError, EngineUnavailable, zmq.ZMQError):
            log.debug("abort of %s not sent", rid)

    # ------------------------------------------------------------------- admin
    async def admin(
        self,
        op: str,
        token_ids: tuple[int, ...] = (),
        cache_salt: str = "",
        timeout_s: float = 10.0,
        **options: Any,
    ) -> AdminReply:
        """One admin call; `options` are further `AdminRequest` fields (tiers, ttl_s...)."""
        if self._dead is not None:
            raise EngineUnavailable(self._dead)
        fields = dict(token_ids=token_ids, cache_salt=cache_salt, **options)
        return await self._admin_call(op, timeout_s, **fields)

    async def _admin_call(self, op: str, timeout_s: float, **fields: Any) -> AdminReply:
        """`admin` without the check that the client is up; `fields`: `AdminRequest`'s."""
        req_id = uuid.uuid4().hex
        fut: asyncio.Future[AdminReply] = asyncio.get_running_loop().create_future()
        self._admin[req_id] = fut
        try:
            async with asyncio.timeout(timeout_s):  # a send waits while no engine is connected
                await self._send(AdminRequest(req_id, op, **fields))
                return await fut
        except TimeoutError as exc:
            raise EngineUnavailable(f"the engine did not answer {op!r} in {timeout_s}s") from exc
        finally:
            self._admin.pop(req_id, None)

    async def ping(self, timeout_s: float) -> AdminReply:
        """One "health" call, made even while the client is down (the watchdog's ping)."""
        return await self._admin_call("health", timeout_s)

    async def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> dict[str, object]:
        """Ask for "health" until the engine answers (it answers once the model is loaded).

        Asks even while the client is down (an engine restarting): that is how the
        launcher learns the new one is up, before it calls `engine_back`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise EngineUnavailable(f"the engine was not healthy within {timeout_s}s")
            try:
                reply = await self._admin_call("health", min(poll_s, left))
            except EngineUnavailable:
                await asyncio.sleep(HEALTH_RETRY_S)  # sockets being made anew: don't spin
                continue
            if reply.ok:
                return reply.payload
