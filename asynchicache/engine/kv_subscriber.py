"""`KvEventSubscriber`: a router's side of the KV event stream (engine/kv_events.py).

It holds the set of pages per tier of one engine, built from the published
batches, and keeps it exact: it asks the replay socket for the contents when
it starts (batches published before its subscription took hold are lost to
it), and again whenever a batch number jumps (batches dropped by a full
queue, or while it was away). Batches numbered at or below the replay's are
already in it and skipped. A replay comes in parts (at most 10,000 events
each), asked for one after another and applied together.

`curve`: the server's public key and this client's certificate, for an engine
that publishes with ZeroMQ CURVE (engine/kv_event_access.py).

    sub = KvEventSubscriber("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    sub.catch_up()
    while True:
        sub.poll(100)
        ...  sub.tiers["disk"]  # page hashes the instance holds on disk
"""

from __future__ import annotations

import time

import zmq

from asynchicache.engine.kv_event_access import ClientCurve
from asynchicache.engine.kv_event_messages import KVEventBatch, decode, read_seq, seq_frame
from asynchicache.storage.sockets import queued
from asynchicache.tiers import TIERS, AllBlocksCleared, BlockRemoved, BlockStored


class KvEventSubscriber:
    """Pages per tier from one engine's KV events; not thread-safe, never blocks unless asked
    (`catch_up`)."""

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
        self.tiers: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self.last: int | None = None  # number of the last batch applied
        self.gaps = 0  # jumps in the numbers seen (each one answered by a replay)
        self.replays = 0
        self._waiting: list[KVEventBatch] = []  # live batches while a replay is asked for
        self._replay_pending = False
        self._parts: list[KVEventBatch] = []  # the parts of the replay received so far
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

    def request_replay(self) -> None:
        """Ask the engine for its contents; `poll()` applies them when they come."""
        if not self._replay_pending:
            self._parts = []
            self._replay.send_multipart([b"", b"replay"])  # a REQ socket's envelope
            self._replay_pending = True

    def poll(self, timeout_ms: int = 0) -> int:
        """Take what came (waiting up to `timeout_ms` for anything); returns batches
        applied. Before the first replay, and after a jump in the numbers, live batches
        wait for a replay (asked for here)."""
        poller = zmq.Poller()
        if self._sub is not None:
            poller.register(self._sub, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        if not poller.poll(timeout_ms):
            return 0
        applied = self._take_replay()
        if self._sub is not None:
            for _topic, seq, payload in queued(self._sub.recv_multipart):
                applied += self._live(read_seq(seq), payload)
        return applied + self._take_replay()

    def catch_up(self, timeout_ms: int = 30_000) -> int:
        """Ask for a replay and wait until it is applied (a router in its own process);
        returns the batch number what is held is exact at."""
        self.request_replay()
        deadline = time.monotonic() + timeout_ms / 1000
        while self._replay_pending:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise TimeoutError(f"no replay in {timeout_ms} ms")
            self.poll(left)
        assert self.last is not None
        return self.last

    def _live(self, number: int, payload: bytes) -> int:
        if self.last is not None and number <= self.last:
            return 0  # already in the replay applied
        if self._replay_pending:
            self._waiting.append(decode(payload))
            return 0
        if self.last is None or number != self.last + 1:
            self.gaps += self.last is not None
            self._waiting.append(decode(payload))
            self.request_replay()
            return 0
        self._apply(decode(payload))
        return 1

    def _take_replay(self) -> int:
        try:
            _empty, seq, payload = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return 0
        part = decode(payload)
        if not part.replay or part.seq != read_seq(seq) or not 0 <= part.part < part.parts:
            raise ValueError("the replay socket answered with something else than a replay")
        if part.part == 0:
            self._parts = []  # a first part, or the snapshot expired: start over
        elif not self._parts or (part.seq, part.part) != (self._parts[0].seq, len(self._parts)):
            return 0  # not the part asked for (an answer to an older request)
        self._parts.append(part)
        if len(self._parts) < part.parts:
            self._replay.send_multipart([b"", b"replay", seq_frame(part.seq),
                                         seq_frame(len(self._parts))])  # fmt: skip
            return 0
        events = tuple(e for p in self._parts for e in p.events)
        batch = KVEventBatch(part.seq, part.ts, events, replay=True)
        self._parts = []
        self._replay_pending = False
        self.replays += 1
        self._apply(batch)
        waiting, self._waiting = self._waiting, []
        applied = 1
        for live in sorted(waiting, key=lambda b: b.seq):
            if live.seq == (self.last or 0) + 1:
                self._apply(live)
                applied += 1
        if any(live.seq > (self.last or 0) for live in waiting):
            # The replay is older than the first live batch held (the engine shares a
            # recent snapshot between askers): what lies between is lost, ask again.
            self.gaps += 1
            self._waiting = [b for b in waiting if b.seq > (self.last or 0)]
            self.request_replay()
        return applied

    def _apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            pages = self.tiers.setdefault(event.tier, set())
            if isinstance(event, BlockStored):
                pages.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                pages.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                pages.clear()
        self.last = batch.seq

    def counts(self) -> dict[str, int]:
        return {t: len(p) for t, p in self.tiers.items()}

    def close(self) -> None:
        self.disconnect()
        self._replay.close(linger=0)
        self._ctx.term()
