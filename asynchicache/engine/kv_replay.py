"""`ReplayServer`: the replay socket's side of the KV event stream, in bounded parts.

A late or lagging subscriber asks for the contents of every tier (a snapshot exact
as of batch `seq`, engine/kv_event_messages.py). One answer could hold the whole
cache (1,479 pages, 330 KB in one frame once) and every request made the engine walk
its tree again, so:

* a snapshot is cut into parts of at most `max_events` events (a stored run counts
  once per page; a longer run is split), asked for one at a time: part 0 starts a
  snapshot, part i of snapshot `seq` continues it;
* a snapshot is taken at most once per `min_interval_s` (a flood of first requests
  shares one; its subscribers catch up on the live batches after it), and at most
  `keep` snapshots are held, each for `ttl_s`: a part of one no longer held is
  answered with part 0 of the newest, which tells the asker to start again;
* each `answer()` (once per engine tick) serves at most `per_tick` requests; the
  others wait in the socket, whose queue is bounded (`rcvhwm`), and ZeroMQ takes
  turns between askers, so one flooding client cannot starve another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice

import zmq

from asynchicache.engine.kv_event_messages import KVEventBatch, encode, read_seq, seq_frame
from asynchicache.storage.sockets import queued
from asynchicache.tiers import BlockStored, TierEvent

log = logging.getLogger(__name__)

MAX_REPLAY_EVENTS = 10_000


@dataclass(frozen=True)
class ReplayLimits:
    max_events: int = MAX_REPLAY_EVENTS  # per answer
    per_tick: int = 4  # requests answered per engine tick
    min_interval_s: float = 1.0  # between two snapshots
    keep: int = 2  # snapshots held
    ttl_s: float = 30.0  # how long one is held
    rcvhwm: int = 1000  # requests queued in the socket


@dataclass(frozen=True)
class _Snapshot:
    seq: int
    taken_at: float
    parts: tuple[bytes, ...]  # encoded KVEventBatch of each part


def weight(event: TierEvent) -> int:
    """What an event counts against `max_events`: a stored run once per page."""
    return len(event.block_hashes) if isinstance(event, BlockStored) else 1


def split(events: list[TierEvent], max_events: int) -> list[list[TierEvent]]:
    """`events` in order, in parts of at most `max_events` (runs split where needed)."""
    parts: list[list[TierEvent]] = [[]]
    room = max_events
    for event in events:
        while weight(event) > room:
            if isinstance(event, BlockStored) and room > 0:
                head, event = _split_run(event, room)
                parts[-1].append(head)
            parts.append([])
            room = max_events
        parts[-1].append(event)
        room -= weight(event)
    return parts


def _split_run(run: BlockStored, n: int) -> tuple[BlockStored, BlockStored]:
    """The first `n` pages of a run, and the rest (whose parent is the n-th page)."""
    size = run.block_size
    assert size is not None  # a run on the wire says its block size (kv_events.to_wire)
    tokens = len(run.token_ids) == len(run.block_hashes) * size
    cut = n * size
    hashes, ids = run.block_hashes, run.token_ids
    head = replace(run, block_hashes=hashes[:n], token_ids=ids[:cut] if tokens else ())
    tail = replace(run, block_hashes=hashes[n:], parent_block_hash=hashes[n - 1],
                   token_ids=ids[cut:] if tokens else ())  # fmt: skip
    return head, tail


class ReplayServer:
    """Answers replay requests on a ROUTER socket; `snapshot()` gives the contents."""

    def __init__(
        self,
        sock: zmq.Socket,
        snapshot: Callable[[], KVEventBatch],
        limits: ReplayLimits = ReplayLimits(),
    ) -> None:
        self.sock = sock
        self.limits = limits
        self._take = snapshot
        self._snapshots: list[_Snapshot] = []
        self.answered = 0
        self.snapshots_taken = 0

    def answer(self) -> int:
        """Serve at most `per_tick` waiting requests; how many were served."""
        served = 0
        for frames in islice(queued(self.sock.recv_multipart), self.limits.per_tick):
            envelope, request = _envelope(frames)
            seq, part = _wanted(request)
            snap, index = self._part(seq, part)
            try:
                self.sock.send_multipart([*envelope, seq_frame(snap.seq), snap.parts[index]],
                                         zmq.NOBLOCK)  # fmt: skip
            except zmq.ZMQError as exc:  # the asker went away, or its queue is full
                log.debug("KV event replay not sent: %s", exc)
            served += 1
        self.answered += served
        return served

    def _part(self, seq: int | None, part: int) -> tuple[_Snapshot, int]:
        now = time.monotonic()
        self._snapshots = [s for s in self._snapshots if now - s.taken_at < self.limits.ttl_s]
        if seq is not None and part > 0:
            held = next((s for s in self._snapshots if s.seq == seq), None)
            if held is not None and part < len(held.parts):
                return held, part
        return self._newest(now), 0

    def _newest(self, now: float) -> _Snapshot:
        if self._snapshots and now - self._snapshots[-1].taken_at < self.limits.min_interval_s:
            return self._snapshots[-1]
        batch = self._take()
        chunks = split(list(batch.events), self.limits.max_events)
        n = len(chunks)
        parts = tuple(
            encode(KVEventBatch(batch.seq, batch.ts, tuple(c), replay=True, part=i, parts=n))
            for i, c in enumerate(chunks)
        )
        snap = _Snapshot(batch.seq, now, parts)
        self._snapshots = [*self._snapshots, snap][-self.limits.keep :]
        self.snapshots_taken += 1
        return snap


def _envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """([identity, (b"" from a REQ socket)], the request's frames)."""
    if len(frames) >= 2 and frames[1] == b"":
        return frames[:2], frames[2:]
    return frames[:1], frames[1:]


def _wanted(request: list[bytes]) -> tuple[int | None, int]:
    """(snapshot seq, part) a request asks for: `[b"replay", seq, part]` (8 bytes each)
    continues a snapshot; anything else starts one."""
    if len(request) == 3:
        try:
            return read_seq(request[1]), max(0, read_seq(request[2]))
        except ValueError:
            pass
    return None, 0
