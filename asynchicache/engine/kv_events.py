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
  socket for the current contents (exact as of the batch number it carries), in
  parts of at most 10,000 events, a bounded number of requests per tick
  (engine/kv_replay.py).

Who may read them: engine/kv_event_access.py (a private ipc:// folder or loopback
unless `--kv-events-allow-remote`, and then ZeroMQ CURVE). What they show: page
hashes of every tier, and the token ids of the shared namespace's pages only; a
`cache_salt`'s pages go out as hashes (engine/kv_event_privacy.py).

Everything runs on the engine's thread, between steps (`tick()`); the PUB
socket drops batches a slow subscriber cannot take (its high-water mark), which
that subscriber sees as a gap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import zmq

from asynchicache.config import LaunchConfig
from asynchicache.engine.kv_event_access import (
    CurveGuard,
    CurveKeys,
    check_endpoint,
    prepare_ipc,
)
from asynchicache.engine.kv_event_messages import (
    KVEventBatch,
    encode,
    seq_frame,
)
from asynchicache.engine.kv_event_privacy import PublicChains
from asynchicache.engine.kv_replay import ReplayLimits, ReplayServer
from asynchicache.engine.storage_mirror import StorageMirror
from asynchicache.storage.admin_messages import ContentsReply
from asynchicache.tiers import STORAGE_TIERS, AllBlocksCleared, BlockStored, TierEvent

if TYPE_CHECKING:  # the launcher imports this module for its config: no torch there
    from asynchicache.cache.hierarchy import HiRadixCache
    from asynchicache.storage.client.storage_client import StorageClient

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
    allow_remote: bool = False  # --kv-events-allow-remote (and then `curve` is required)
    curve: CurveKeys | None = None  # --kv-events-curve-secret-key / --kv-events-curve-clients
    replay: ReplayLimits = field(default_factory=ReplayLimits)

    def __post_init__(self) -> None:
        for flag, addr in (("--kv-events-endpoint", self.endpoint),
                           ("--kv-events-replay-endpoint", self.replay_endpoint)):  # fmt: skip
            if addr is not None:
                check_endpoint(flag, addr, self.allow_remote, self.curve)
        if self.curve is not None:
            self.curve.check()
        if self.interval_s < 0:
            raise ValueError(f"the KV event interval must be >= 0, got {self.interval_s}")


def kv_events_config(launch: LaunchConfig) -> KvEventsConfig | None:
    """The KV events `serve` was asked for (None: off); ValueError naming the flag."""
    if launch.kv_events_endpoint is None:
        return None
    curve = None
    if launch.kv_events_curve_secret_key is not None and launch.kv_events_curve_clients:
        curve = CurveKeys(launch.kv_events_curve_secret_key, launch.kv_events_curve_clients)
    return KvEventsConfig(
        launch.kv_events_endpoint,
        launch.kv_events_replay_endpoint,
        allow_remote=launch.kv_events_allow_remote,
        curve=curve,
    )


def to_wire(event: TierEvent, page_size: int) -> TierEvent:
    """`event` as routers get it: a stored run says its block size (the service cannot)."""
    if isinstance(event, BlockStored):
        return replace(event, block_size=page_size)
    return event


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
        self.public = PublicChains(cache.tree.root_hash)
        self.seq = 0  # the number of the last batch published
        self._synced = storage is None
        self._last_walk = 0.0
        self._last_sync_try = 0.0
        self._topic = config.topic.encode()
        self._guard = CurveGuard(ctx, config.curve) if config.curve is not None else None
        self._pub = self._socket(ctx, zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.send_hwm)
        self._pub.bind(config.endpoint)
        self.replays: ReplayServer | None = None
        if config.replay_endpoint is not None:
            router = self._socket(ctx, zmq.ROUTER, config.replay_endpoint)
            router.setsockopt(zmq.RCVHWM, config.replay.rcvhwm)
            router.bind(config.replay_endpoint)
            self.replays = ReplayServer(router, self.snapshot, config.replay)
        log.info("publishing KV events on %s (replay: %s%s)", config.endpoint,
                 config.replay_endpoint, "; CURVE" if self._guard else "")  # fmt: skip

    def _socket(self, ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
        prepare_ipc(endpoint)
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._guard is not None:
            self._guard.secure(sock)
        return sock

    def tick(self) -> None:
        """Publish what changed (L1/L2 at most every `interval_s`); answer replay requests."""
        self._flush(force=False)
        if self.replays is not None:
            self.replays.answer()

    def _flush(self, force: bool) -> None:
        events = self._storage_events()
        now = time.monotonic()
        if self.residency.changed and (force or now - self._last_walk >= self.config.interval_s):
            self._last_walk = now
            events += self.residency.changes()
        if events:
            self._publish(events)

    # -- L3/L4 ----------------------------------------------------------------------------

    def _storage_events(self) -> list[TierEvent]:
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

    def _resync(self) -> list[TierEvent]:
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

    def _publish(self, events: list[TierEvent]) -> None:
        self.seq += 1
        wire = tuple(to_wire(e, self.page_size) for e in self.public.filter(events))
        if len(self.public) > self.public.prune_at:
            self._prune()
        payload = encode(KVEventBatch(self.seq, time.time(), wire))
        try:
            self._pub.send_multipart([self._topic, seq_frame(self.seq), payload], zmq.NOBLOCK)
        except zmq.Again:  # PUB never blocks; a full subscriber loses the batch (a gap)
            log.debug("KV event batch %d dropped", self.seq)

    def snapshot(self) -> KVEventBatch:
        """Every tier's contents as of batch `seq` (publishes pending changes first)."""
        self._flush(force=True)
        events: list[TierEvent] = [*self.residency.snapshot(), *self.mirror.snapshot()]
        wire: list[TierEvent] = [AllBlocksCleared(t) for t in STORAGE_TIERS]
        wire += [to_wire(e, self.page_size) for e in self.public.filter(events)]
        return KVEventBatch(self.seq, time.time(), tuple(wire), replay=True)

    def _prune(self) -> None:
        self.public.prune(self.residency.pages().union(*self.mirror.tiers.values()))

    def close(self) -> None:
        self._pub.close(linger=0)
        if self.replays is not None:
            self.replays.sock.close(linger=0)
        if self._guard is not None:
            self._guard.close()
