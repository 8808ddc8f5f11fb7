"""Admission: how many requests work at once, how many wait, and whose turn is next.

    --max-concurrent-requests R   requests of the work routes (ADMITTED_PATHS) running
    --max-waiting-requests W      requests waiting for one of those R slots

A request past both is answered 429 with `Retry-After` at once, before its body is
read (issue 39: 200 concurrent requests were all accepted, and one client's burst
delayed every other client's first token). Fair share between clients: a client is
its bearer key (or, without one, its address).

* When a slot frees, the next request is the oldest of the client that runs fewest
  requests now, of those the one served least recently (round robin): a burst of one
  client does not go ahead of another's first request.
* When the queue is full, a newcomer takes the place of the newest waiter of the
  client that holds most of the queue, if that client holds more than one place more
  than the newcomer's client would: one client's burst cannot keep the others out.

Invariants (checked by `check`): running == sum of running per client <= R (a freed
slot is handed on before anything else runs); waiting == sum of queue lengths <= W; a
client's entries exist only while it runs or waits.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from asynchicache.server.errors import APIError

# The routes that make the engine (or a tokenizer) work; everything else answers at once.
ADMITTED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
    "/v1/completions/render", "/v1/chat/completions/render",
})  # fmt: skip
RETRY_AFTER_S = 1


class Refused(Exception):
    """No place for this request: answered 429."""


@dataclass
class _Waiter:
    client: bytes
    seq: int
    granted: asyncio.Future[None]


@dataclass
class Admission:
    """The counts and queues of one server (one event loop)."""

    max_running: int
    max_waiting: int
    running: int = 0
    waiting: int = 0
    _running: dict[bytes, int] = field(default_factory=dict)
    _queues: dict[bytes, deque[_Waiter]] = field(default_factory=dict)
    _served: dict[bytes, int] = field(default_factory=dict)  # client -> seq of its last turn
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    async def enter(self, client: bytes) -> None:
        """Return once `client` may run a request (then `leave` exactly once); Refused
        when there is no place, now or later (made room for another client)."""
        if self.running < self.max_running and not self.waiting:
            self._start(client)
            return
        waiter = _Waiter(client, next(self._seq), asyncio.get_running_loop().create_future())
        self._queue(waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.leave(client)  # granted as the client left: hand the slot on
            else:
                self._unqueue(waiter)
            raise

    def leave(self, client: bytes) -> None:
        """One request of `client` ended; the next waiter runs in its place."""
        self.running -= 1
        self._running[client] -= 1
        if not self._running[client]:
            del self._running[client]
            self._forget(client)
        self._wake()

    def _start(self, client: bytes) -> None:
        self.running += 1
        self._running[client] = self._running.get(client, 0) + 1
        self._served[client] = next(self._seq)

    def _forget(self, client: bytes) -> None:
        """A client neither running nor waiting leaves no trace."""
        if client not in self._running and client not in self._queues:
            self._served.pop(client, None)

    def _queue(self, waiter: _Waiter) -> None:
        if self.waiting >= self.max_waiting:
            self._make_room(waiter.client)
        self._queues.setdefault(waiter.client, deque()).append(waiter)
        self.waiting += 1

    def _make_room(self, client: bytes) -> None:
        """Refuse the newest waiter of the client that holds most of the queue, when it
        holds more than one place more than `client` would; else refuse `client`."""
        mine = len(self._queues.get(client, ()))
        hog = max(self._queues, key=lambda c: len(self._queues[c]), default=None)
        if hog is None or len(self._queues[hog]) <= mine + 1:
            raise Refused(self._full_message())
        evicted = self._queues[hog].pop()
        self._forget_queue(hog)
        self.waiting -= 1
        evicted.granted.set_exception(Refused(self._share_message()))

    def _unqueue(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.waiting -= 1
            self._forget_queue(waiter.client)

    def _forget_queue(self, client: bytes) -> None:
        if not self._queues[client]:
            del self._queues[client]
            self._forget(client)

    def _wake(self) -> None:
        while self.running < self.max_running and self._queues:
            client = min(self._queues, key=self._turn_order)
            waiter = self._queues[client].popleft()
            self._forget_queue(client)
            self.waiting -= 1
            self._start(client)
            waiter.granted.set_result(None)

    def _turn_order(self, client: bytes) -> tuple[int, int, int]:
        """Fewest running first, then least recently served, then the oldest waiter."""
        return (self._running.get(client, 0), self._served.get(client, -1),
                self._queues[client][0].seq)  # fmt: skip

    def _full_message(self) -> str:
        return (
            f"the server is busy: {self.running} requests run (--max-concurrent-requests "
            f"{self.max_running}) and {self.waiting} wait (--max-waiting-requests "
            f"{self.max_waiting}); retry after {RETRY_AFTER_S} s"
        )

    def _share_message(self) -> str:
        return (
            f"the server is busy and this key holds more than its share of the "
            f"{self.max_waiting} waiting places (--max-waiting-requests): another key's "
            f"request took this one's place; retry after {RETRY_AFTER_S} s"
        )

    def check(self) -> None:
        """The invariants of the module docstring (for tests)."""
        assert self.running == sum(self._running.values()) <= self.max_running
        assert self.waiting == sum(map(len, self._queues.values())) <= self.max_waiting
        assert all(self._running.values()) and all(self._queues.values())
        assert set(self._served) <= set(self._running) | set(self._queues)


class AdmissionMiddleware:
    """Holds a slot of `admission` for the whole of each work request (a stream too)."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ADMITTED_PATHS:
            await self.app(scope, receive, send)
            return
        client = _client(scope)
        try:
            await self.admission.enter(client)
        except Refused as exc:
            err = APIError(429, str(exc), code="too_many_requests").response()
            err.headers["Retry-After"] = str(RETRY_AFTER_S)
            await err(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave(client)


def _client(scope: Scope) -> bytes:
    """Who is asking: the bearer key (checked by server/guards/auth.py before this runs), or,
    without one, the peer's address."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return b"key " + value
    peer = scope.get("client")
    return b"addr " + (peer[0].encode() if peer else b"?")
