"""Is the cache service answering? A health ping that never blocks, for its supervisor.

A service can be alive but silent (stopped by a signal, hung in its loop):
the engine's tickets then time out and their slots stay quarantined until the
service settles them or exits. The supervisor pings it with `Stats` on every
watch turn (`silent_s()` sends a ping, takes any answers and returns at once)
and restarts it when it stays silent too long; its exit settles the engines'
quarantine.
"""

from __future__ import annotations

import contextlib
import itertools
import time

import zmq

from asynchicache.storage.messages import Stats, StatsReply, decode, encode


class ServiceProbe:
    """Pings the cache service at `address`; not thread-safe."""

    def __init__(self, address: str) -> None:
        self._ids = itertools.count(1)
        self._started = time.monotonic()
        self._last_answer: float | None = None
        self.last_ping = 0  # id of the last ping sent (or tried)
        self.last_answered = 0  # the highest ping id answered
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no pings queued for a service not there
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._sock.connect(address)

    def silent_s(self) -> float:
        """Seconds since the service last answered (since this probe started, before its
        first answer). Takes the answers that came, sends the next ping; never blocks."""
        while True:
            try:
                reply = decode(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            except ValueError:
                continue
            if isinstance(reply, StatsReply):
                self._last_answer = time.monotonic()
                self.last_answered = max(self.last_answered, reply.req_id)
        # zmq.Again: not connected, or its queue is full of unanswered pings.
        self.last_ping = next(self._ids)
        with contextlib.suppress(zmq.Again):
            self._sock.send(encode(Stats(self.last_ping)), zmq.NOBLOCK)
        since = self._last_answer if self._last_answer is not None else self._started
        return time.monotonic() - since

    @property
    def answered(self) -> bool:
        """Whether the service answered at least once."""
        return self._last_answer is not None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
