"""`KvEventSubscriber`: a router's side of the KV event stream (kv_events/publisher.py), as a
client library for tests, benchmarks and tools; it reads any vLLM-format publisher.

It holds the set of block hashes per tier of one instance, built from the published
batches (media mapped back to tiers: kv_events/wire.py), and keeps it exact: it asks the
replay socket (vLLM's protocol) from batch 0 when it starts, from the first batch it
lacks when the numbers jump (batches dropped by a full queue, or while it was away), and
from 0 again when they go back (the publisher restarted). Batches numbered at or below
the last one applied are skipped.

`curve`: the server's public key and this client's certificate, for an engine that
publishes with ZeroMQ CURVE (kv_events/access.py).

    sub = KvEventSubscriber("ipc:///run/ac/events.sock", "ipc:///run/ac/replay.sock")
    sub.catch_up()
    while True:
        sub.poll(100)
        ...  sub.tiers["disk"]  # block hashes the instance holds on disk
"""

from __future__ import annotations

import time

import zmq

from asynchicache.common.sockets import queued
from asynchicache.common.tiers import TIERS
from asynchicache.kv_events import wire
from asynchicache.kv_events.access import ClientCurve


class KvEventSubscriber:
    """Block hashes per tier from one instance's KV events; not thread-safe, never blocks
    unless asked (`catch_up`)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        topic: str = "",
        rcvhwm: int = 10_000,
        curve: ClientCurve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self.topic = topic.encode()
        self.rcvhwm = rcvhwm
        self.tiers: dict[str, set[int]] = {t: set() for t in TIERS}
        self.last: int | None = None  # number of the last batch applied
        self.gaps = 0  # jumps in the numbers seen (each one answered by a replay)
        self.restarts = 0  # numbers that went back
        self.replays = 0
        self._waiting: list[tuple[int, bytes]] = []  # live batches while a replay runs
        self._replay_pending = False
        self._live_seen: int | None = None
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self._replay = self._socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay_endpoint)
        self.connect()

    def connect(self) -> None:
        """(Re)open the subscription; what was published while away shows as a gap."""
        self.disconnect()
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock

    def disconnect(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    @property
    def synced(self) -> bool:
        """Whether what is held follows the stream (no replay pending, one applied)."""
        return self.last is not None and not self._replay_pending

    def request_replay(self, start: int | None = None) -> None:
        """Ask for the batches from `start` (default: the one after the last applied, or 0);
        `poll()` applies them when they come."""
        if not self._replay_pending:
            first = start if start is not None else (0 if self.last is None else self.last + 1)
            self._replay.send_multipart([b"", wire.seq_frame(first)])
            self._replay_pending = True

    def poll(self, timeout_ms: int = 0) -> int:
        """Take what came (waiting up to `timeout_ms` for anything); returns batches applied."""
        poller = zmq.Poller()
        if self._sub is not None:
            poller.register(self._sub, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        if not poller.poll(timeout_ms):
            return 0
        applied = self._take_replay()
        if self._sub is not None:
            for _topic, seq, payload in queued(self._sub.recv_multipart):
                applied += self._live(wire.read_seq(seq), payload)
        return applied + self._take_replay()

    def catch_up(self, timeout_ms: int = 30_000) -> int:
        """Ask for a replay and wait until it is applied; returns the last batch applied."""
        self.request_replay()
        deadline = time.monotonic() + timeout_ms / 1000
        while self._replay_pending or self.last is None:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise TimeoutError(f"no replay in {timeout_ms} ms")
            self.poll(min(left, 100))
            if not self._replay_pending and self.last is None:
                self.request_replay()
        return self.last

    def _live(self, number: int, payload: bytes) -> int:
        # Live numbers only grow, in one run of the publisher: one that goes back is a
        # publisher that restarted (a replay's numbers may pass the live ones: not this).
        back = self._live_seen is not None and number < self._live_seen
        self._live_seen = number
        if back:
            self._restarted()
        if self._replay_pending:
            self._waiting.append((number, payload))
            return 0
        if self.last is not None and number <= self.last:
            return 0  # already applied (from a replay)
        if self.last is None or number != self.last + 1:
            self.gaps += self.last is not None
            self._waiting.append((number, payload))
            self.request_replay()
            return 0
        self._apply(number, wire.decode(payload))
        return 1

    def _restarted(self) -> None:
        self.restarts += 1
        self.tiers = {t: set() for t in TIERS}
        self.last = None
        self._waiting = []
        self._replay_pending = False  # an answer from the old run may still come: harmless
        self.request_replay(0)

    def _take_replay(self) -> int:
        applied = 0
        while self._replay_pending:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return applied
            if len(frames) != 4:
                raise ValueError("the replay socket answered with something else than a batch")
            seq = wire.read_seq(frames[2])
            if seq == wire.END_SEQ:
                self._replay_pending = False
                self.replays += 1
                return applied + self._drain_waiting()
            if self.last is None or seq > self.last:
                self._apply(seq, wire.decode(frames[3]))
                applied += 1
        return applied

    def _drain_waiting(self) -> int:
        waiting, self._waiting = sorted(self._waiting), []
        applied = 0
        for number, payload in waiting:
            if self.last is not None and number <= self.last:
                continue
            if self.last is not None and number != self.last + 1:
                self.gaps += 1  # still a hole (the buffer moved on): ask again
                self._waiting = [(n, p) for n, p in waiting if n > self.last]
                self.request_replay()
                return applied
            self._apply(number, wire.decode(payload))
            applied += 1
        return applied

    def _apply(self, number: int, batch: wire.KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, wire.AllBlocksCleared):
                self.tiers = {t: set() for t in TIERS}
                continue
            pages = self.tiers.setdefault(
                wire.TIER_OF_MEDIUM.get(event.medium, event.medium), set()
            )
            if isinstance(event, wire.BlockStored):
                pages.update(event.block_hashes)
            else:
                pages.difference_update(event.block_hashes)
        self.last = number

    def counts(self) -> dict[str, int]:
        return {t: len(p) for t, p in self.tiers.items()}

    def close(self) -> None:
        self.disconnect()
        self._replay.close(linger=0)
        self._ctx.term()
