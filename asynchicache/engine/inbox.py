"""The engine's inbox: its socket read and decoded on a thread of its own, during steps too.

The engine loop used to read its socket only between steps, so a request that
arrived while a long prompt's step ran was not even read until the step ended
(~1 s of a pressure run's `http_in_s`). `Inbox` receives and decodes every
message as it arrives, stamps it with its time of arrival (`Received.at`,
`time.monotonic()`: the request's `arrival`, where its trace starts), and queues
it; the loop takes what arrived before each step (`take`), in order.

Invariants:
* only the inbox's thread touches the PULL socket, from `start` until `close`
  returns (a ZeroMQ socket is not thread-safe); the loop's thread alone sends;
* the thread never spins: it blocks in `poll` (at most `POLL_MS`, to see `close`)
  and in the queue; decoding costs ~30 us a message (codec.py), so it takes
  next to nothing from the step's torch threads (engine/threads.py);
* a message that fails to decode is logged and dropped, never raised: the
  thread survives it, as it survives (logs and counts) any other failure;
* messages keep their order (an abort after its request, admin after both).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from asynchicache.common.sockets import queued
from asynchicache.engine.protocol import decode

log = logging.getLogger(__name__)

POLL_MS = 100  # how soon the thread sees `close` while no message comes
FAILURE_PAUSE_S = 0.05  # after an unexpected failure, before it reads again


@dataclass(frozen=True)
class Received:
    """A decoded message and when the engine had it (`time.monotonic()`)."""

    msg: object
    at: float


class Inbox:
    """Reads and decodes the engine's PULL socket on a thread (module docstring)."""

    def __init__(self, pull: zmq.Socket, poll_ms: int = POLL_MS) -> None:
        self._pull = pull
        self._poll_ms = poll_ms
        self._queue: queue.SimpleQueue[Received] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-inbox", daemon=True)
        self.received = 0  # messages decoded and queued
        self.dropped = 0  # messages that failed to decode
        self.failures = 0  # unexpected errors of the thread (it logs them and goes on)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; the socket is the caller's again once this returns."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def take(self, wait_s: float = 0.0) -> list[Received]:
        """Everything received so far, oldest first; with none, waits up to `wait_s` for
        the first (a blocking wait: an idle engine spends no CPU here)."""
        out: list[Received] = []
        if wait_s > 0:
            try:
                out.append(self._queue.get(timeout=wait_s))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._pull.poll(self._poll_ms):
                    for raw in queued(self._pull.recv):
                        self._put(raw)
            except zmq.ContextTerminated:
                return
            except Exception:
                self.failures += 1
                log.exception("the engine's inbox failed to read; it goes on")
                time.sleep(FAILURE_PAUSE_S)

    def _put(self, raw: bytes) -> None:
        try:
            msg = decode(raw)
        except ValueError as exc:
            self.dropped += 1
            log.warning("dropping a malformed message: %s", exc)
            return
        self._queue.put(Received(msg, time.monotonic()))
        self.received += 1
