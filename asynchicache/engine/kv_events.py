"""`KvEventPublisher`: one stream of KV events for every tier of one engine, for routers.

Routers that send a request to the instance holding its prefix (llm-d's
KV-cache-aware scheduler, vLLM's production-stack router, SGLang's router)
learn what each instance holds from KV events. The engine publishes one
numbered stream (messages: engine/kv_event_messages.py):

* L1/L2 events come from comparing the tree with what was last published
  (cache.residency), at most every `interval_s` and only after a change;
* L3/L4 events are the cache service's, relayed (engine/storage_mirror.py keeps
  the pages they describe, and resyncs from the service's contents when some
  were lost); together one sequence, so a subscriber needs one socket;
* a router that starts late, or sees a sequence number jump, asks the replay
  socket for the current contents (exact as of the batch number it carries).

Everything runs on the engine's thread, between steps (`tick()`); the PUB
socket drops batches a slow subscriber cannot take (its high-water mark), which
that subscriber sees as a gap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.engine.kv_event_messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode,
    seq_frame,
)
from asynchicache.engine.storage_mirror import STORAGE_TIERS, StorageMirror
from asynchicache.storage.admin_messages import ContentsReply
from asynchicache.storage.client import StorageClient
from asynchicache.storage.events import PagesRemoved, PagesStored, StorageEvent
from asynchicache.storage.sockets import queued

log = logging.getLogger(__name__)

RESYNC_EVERY_S = 1.0  # how often to retry asking the service for its contents
CONTENTS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class KvEventsConfig:
    """Where the engine publishes (`--kv-events-endpoint`) and answers replays."""

    endpoint: str  # PUB, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None = None  # ROUTER
    topic: str = ""
    interval_s: float = 0.02  # the least time between two walks of the tree
    send_hwm: int = 10_000  # batches queued per subscriber before it loses some

    def __post_init__(self) -> None:
        for flag, addr in (("--kv-events-endpoint", self.endpoint),
                           ("--kv-events-replay-endpoint", self.replay_endpoint)):  # fmt: skip
            if addr is not None and not addr.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{flag} must be a ZeroMQ address like tcp://127.0.0.1:5557, "
                                 f"got {addr!r}")  # fmt: skip
        if self.interval_s < 0:
            raise ValueError(f"the KV event interval must be >= 0, got {self.interval_s}")


def to_wire(event: StorageEvent, page_size: int) -> KVEvent:
    if isinstance(event, PagesStored):
        return BlockStored(event.tier, event.page_hashes, event.parent or None, event.tokens,
                           page_size)  # fmt: skip
    if isinstance(event, PagesRemoved):
        return BlockRemoved(event.tier, event.page_hashes)
    return AllBlocksCleared(event.tier)


class KvEventPublisher:
    """Publishes the engine's KV events; call `tick()` from the engine loop, `close()` at exit."""

    def __init__(
        self,
        config: KvEventsConfig,
        cache: HiRadixCache,
        ctx: zmq.Context,
        storage: StorageClient | None = None,
    ) -> None:
        self.config = config
        self.page_size = cache.page_size
        self.residency = cache.residency()
        self.storage = storage
        self.mirror = StorageMirror(cache.page_size)
        self.seq = 0  # the number of the last batch published
        self._synced = storage is None
        self._last_walk = 0.0
        self._last_sync_try = 0.0
        self._topic = config.topic.encode()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, config.send_hwm)
        self._pub.bind(config.endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        log.info("publishing KV events on %s (replay: %s)", config.endpoint,
                 config.replay_endpoint)  # fmt: skip

    def tick(self) -> None:
        """Publish what changed (L1/L2 at most every `interval_s`); answer replay requests."""
        self._flush(force=False)
        self._answer_replays()

    def _flush(self, force: bool) -> None:
        events = self._storage_events()
        now = time.monotonic()
        if self.residency.changed and (force or now - self._last_walk >= self.config.interval_s):
            self._last_walk = now
            events += self.residency.changes()
        if events:
            self._publish(events)

    # -- L3/L4 ----------------------------------------------------------------------------

    def _storage_events(self) -> list[StorageEvent]:
        if self.storage is None:
            return []
        batch = self.storage.take_events()
        if batch.gap:
            self._synced = False
        if self._synced:
            return self.mirror.apply(batch.events)
        out = self._resync()
        if not self._synced:
            return out
        # Events taken before the contents and while waiting for them: those numbered
        # after the contents' seq are newer than it.
        later = self.storage.take_events()
        self._synced = not later.gap
        return out + self.mirror.apply(batch.events + later.events)

    def _resync(self) -> list[StorageEvent]:
        """Ask the service what its tiers hold (bounded wait, throttled retries)."""
        now = time.monotonic()
        if self.storage is None or now - self._last_sync_try < RESYNC_EVERY_S:
            return []
        self._last_sync_try = now
        reply = self.storage.contents(STORAGE_TIERS, timeout_s=CONTENTS_TIMEOUT_S)
        if not isinstance(reply, ContentsReply):
            return []
        self._synced = True
        events = self.mirror.resync(reply)
        log.info("KV events: storage tiers synced at event %d (%s)", reply.seq,
                 self.mirror.counts())  # fmt: skip
        return events

    # -- out --------------------------------------------------------------------------------

    def _publish(self, events: list[StorageEvent]) -> None:
        self.seq += 1
        wire = tuple(to_wire(e, self.page_size) for e in events)
        payload = encode(KVEventBatch(self.seq, time.time(), wire))
        try:
            self._pub.send_multipart([self._topic, seq_frame(self.seq), payload], zmq.NOBLOCK)
        except zmq.Again:  # PUB never blocks; a full subscriber loses the batch (a gap)
            log.debug("KV event batch %d dropped", self.seq)

    def snapshot(self) -> KVEventBatch:
        """Every tier's contents as of batch `seq` (publishes pending changes first)."""
        self._flush(force=True)
        events: list[StorageEvent] = [*self.residency.snapshot(), *self.mirror.snapshot()]
        wire = [AllBlocksCleared(t) for t in STORAGE_TIERS]
        wire += [to_wire(e, self.page_size) for e in events]
        return KVEventBatch(self.seq, time.time(), tuple(wire), replay=True)

    def _answer_replays(self) -> None:
        if self._replay is None:
            return
        for frames in queued(self._replay.recv_multipart):
            # [identity, (b"" from a REQ socket), request...]: echo the envelope.
            envelope = frames[:2] if len(frames) >= 2 and frames[1] == b"" else frames[:1]
            batch = self.snapshot()
            try:
                self._replay.send_multipart([*envelope, seq_frame(batch.seq), encode(batch)],
                                            zmq.NOBLOCK)  # fmt: skip
            except zmq.ZMQError as exc:  # the asker went away
                log.debug("KV event replay not sent: %s", exc)

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
