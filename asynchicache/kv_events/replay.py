"""`ReplayServer`: the replay socket (`--kv-events-replay-endpoint`), on vLLM's protocol.

A subscriber that saw a jump in the batch numbers (vllm-router's `--kv-event-replay-source`,
our kv_events/subscriber.py) sends `[b"", start_seq]` (8 bytes big-endian) from a DEALER
or REQ socket, and gets back, as vLLM's `ZmqEventPublisher` answers:

    [b"", topic, seq, payload]   for each published batch numbered from `start_seq` on
    [b"", b"", END_SEQ, b""]     the end (seq -1)

from a buffer of the last `buffer_steps` batches. A start older than the buffer (or 0,
from a subscriber with nothing) gets a resync first: the publisher publishes
`AllBlocksCleared` and every tier's contents as new batches (kv_events/publisher.py), and
the answer starts there, so what the subscriber applies is exact.

Bounded work: each `answer()` (once per engine tick) serves at most `per_tick` requests,
one answer sends at most `buffer_steps` batches, a resync is taken at most once per
`min_interval_s` (a flood of requests shares one), and the socket's queue is bounded
(`rcvhwm`); ZeroMQ takes turns between askers, so one flooding client cannot starve another.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

import zmq

from asynchicache.common.sockets import queued
from asynchicache.kv_events import wire

log = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 10_000


@dataclass(frozen=True)
class ReplayLimits:
    max_events: int = MAX_BATCH_EVENTS  # per batch (a stored run counts once per page)
    buffer_steps: int = 1000  # batches kept for replay
    per_tick: int = 4  # requests answered per engine tick
    min_interval_s: float = 1.0  # between two resyncs
    rcvhwm: int = 1000  # requests queued in the socket


class ReplaySource(Protocol):
    """What a replay answers from: the publisher's buffer of (seq, payload) batches and its
    resync (kv_events/publisher.py's `KvEventPublisher`)."""

    buffer: deque[tuple[int, bytes]]

    def resync(self) -> int:
        """Publish every tier's contents; the number of the resync's first batch."""
        ...


class ReplayServer:
    """Answers replay requests on a ROUTER socket from `source`'s buffer, under `topic`."""

    def __init__(
        self,
        sock: zmq.Socket,
        source: ReplaySource,
        topic: bytes,
        limits: ReplayLimits = ReplayLimits(),
    ) -> None:
        self.sock = sock
        self.limits = limits
        self.source = source
        self.topic = topic
        self.answered = 0

    def answer(self) -> int:
        """Serve at most `per_tick` waiting requests; how many were served."""
        served = 0
        for frames in islice(queued(self.sock.recv_multipart), self.limits.per_tick):
            envelope, start = _request(frames)
            if start is not None:
                self._send(envelope, start)
            served += 1
        self.answered += served
        return served

    def _send(self, envelope: list[bytes], start: int) -> None:
        buffer = self.source.buffer
        if not buffer or start < buffer[0][0]:
            start = max(start, self.source.resync())
        try:
            for seq, payload in list(buffer):
                if seq >= start:
                    self.sock.send_multipart([*envelope, self.topic, wire.seq_frame(seq), payload],
                                             zmq.NOBLOCK)  # fmt: skip
            self.sock.send_multipart([*envelope, b"", wire.seq_frame(wire.END_SEQ), b""],
                                     zmq.NOBLOCK)  # fmt: skip
        except zmq.ZMQError as exc:  # the asker went away, or its queue is full
            log.debug("KV event replay not sent: %s", exc)


def _request(frames: list[bytes]) -> tuple[list[bytes], int | None]:
    """([identity, b""], the first batch wanted); None: not a replay request."""
    if len(frames) == 3 and frames[1] == b"":
        try:
            return frames[:2], max(0, wire.read_seq(frames[2]))
        except ValueError:
            pass
    return [*frames[:1], b""], None
