"""`KvEventPublisher`: one stream of KV events for every tier of one engine, on vLLM's wire.

Routers that send a request to the instance holding its prefix (vllm-router's `kv_aware`,
llm-d's precise prefix-cache scorer, Dynamo's KV router) learn what each instance holds
from vLLM's KV events (kv_events/wire.py). The engine publishes one numbered stream:

* L1/L2 events come from comparing the tree with what was last published
  (cache.residency), at most every `interval_s` and only after a change;
* L3/L4 events are the cache service's, relayed (kv_events/mirror.py keeps the pages
  they describe, and resyncs from the service's contents when some were lost);
* L4 pages (and L3 pages of a folder the fleet shares, `shared_disk`) are the fleet's:
  they go out with `ownership` = `pool` (llm-d's `pool:<name>`), so a router credits them
  at the external tier's cost and keeps them when this instance restarts (its L1/L2 go);
* with nothing to say for `heartbeat_s`, it publishes an empty batch: a router learns of
  a restart (the numbers go back) or a lost batch (a gap) within that time;
* a subscriber that joins gets a resync (the PUB socket is an XPUB, which hears each
  subscription): a router that (re)starts learns every tier's contents at once, not as
  pages happen to be stored again (vllm-router asks a replay source only on a gap, and
  the first batch it sees is none);
* a subscriber that lost batches asks the replay socket (vLLM's protocol,
  kv_events/replay.py) from the first one it lacks; one older than the replay buffer
  gets a resync: `AllBlocksCleared` and every tier's contents, published as ordinary
  numbered batches of at most `max_events` events (every subscriber applies them).

Who may read them: kv_events/access.py. What they show (kv_events/privacy.py): token
ids and plain block hashes of the shared namespace's pages only; a `cache_salt`'s pages,
and pages whose chain is not known, go out with no tokens under keyed hashes (a secret
of this publisher), so nothing derived from a salt leaves, and no router can match a
request to them. A first page's parent is None, as vLLM's is.

Everything runs on the engine's thread, between steps (`tick()`); the PUB socket drops
batches a slow subscriber cannot take (its high-water mark), which it sees as a gap.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from asynchicache.common.tiers import (
    STORAGE_TIERS,
    TIERS,
    AllBlocksCleared,
    BlockStored,
    Tier,
    TierEvent,
)
from asynchicache.kv_events import wire
from asynchicache.kv_events.access import CurveGuard, CurveKeys, check_endpoint, prepare_ipc
from asynchicache.kv_events.mirror import StorageMirror
from asynchicache.kv_events.privacy import PublicChains
from asynchicache.kv_events.replay import ReplayLimits, ReplayServer
from asynchicache.settings.config import LaunchConfig
from asynchicache.storage.admin_messages import ContentsReply

if TYPE_CHECKING:  # the launcher imports this module for its config: no torch there
    from asynchicache.hierarchy.hierarchy import HiRadixCache
    from asynchicache.storage.client.storage_client import StorageClient

log = logging.getLogger(__name__)

RESYNC_EVERY_S = 1.0  # how often to retry asking the service for its contents
CONTENTS_TIMEOUT_S = 30.0
DEFAULT_POOL = LaunchConfig.kv_events_pool  # serve's --kv-events-pool: defined there


@dataclass(frozen=True)
class KvEventsConfig:
    """Where the engine publishes (`--kv-events-endpoint`) and answers replays."""

    endpoint: str  # PUB, e.g. ipc:///run/user/1000/ac/events.sock
    replay_endpoint: str | None = None  # ROUTER
    topic: str = ""
    interval_s: float = 0.02  # the least time between two walks of the tree
    send_hwm: int = 10_000  # batches queued per subscriber before it loses some
    allow_remote: bool = False  # --kv-events-allow-remote (and then `curve` or `plaintext`)
    curve: CurveKeys | None = None  # --kv-events-curve-secret-key / --kv-events-curve-clients
    plaintext: bool = False  # --kv-events-plaintext: tcp:// without CURVE, readable by others
    replay: ReplayLimits = field(default_factory=ReplayLimits)
    # An empty batch after this long without one: a router notices a restarted instance
    # (its numbers went back) within it, not at its next store, and a lost batch as a gap.
    heartbeat_s: float = 1.0
    pool: str = DEFAULT_POOL  # `ownership` of the fleet's shared pages (L4, shared L3)
    shared_disk: bool = False  # L3 is a folder every instance reads: announce it as the pool's

    def __post_init__(self) -> None:
        for flag, addr in (("--kv-events-endpoint", self.endpoint),
                           ("--kv-events-replay-endpoint", self.replay_endpoint)):  # fmt: skip
            if addr is not None:
                check_endpoint(flag, addr, self.allow_remote, self.curve, self.plaintext)
        if self.curve is not None:
            self.curve.check()
        if self.interval_s < 0:
            raise ValueError(f"the KV event interval must be >= 0, got {self.interval_s}")
        if not self.pool:
            raise ValueError("the KV events' pool name must not be empty")


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
        topic=launch.kv_events_topic,
        allow_remote=launch.kv_events_allow_remote,
        curve=curve,
        plaintext=launch.kv_events_plaintext,
        pool=launch.kv_events_pool,
        shared_disk=launch.kv_events_shared_disk,
    )


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
        self.seq = -1  # the number of the last batch published (vLLM's start at 0)
        self.published: dict[str, set[int]] = {t: set() for t in TIERS}  # wire hashes
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay.buffer_steps)
        self.resyncs = 0
        self._resync_at: tuple[float, int] | None = None  # (when, first seq) of the last
        self._synced = storage is None
        self._last_walk = 0.0
        self._last_publish = 0.0
        self._last_sync_try = 0.0
        self._topic = config.topic.encode()
        self._guard = CurveGuard(ctx, config.curve) if config.curve is not None else None
        self._pub = self._socket(ctx, zmq.XPUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.send_hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not each topic's first
        self._pub.bind(config.endpoint)
        self.replays: ReplayServer | None = None
        if config.replay_endpoint is not None:
            router = self._socket(ctx, zmq.ROUTER, config.replay_endpoint)
            router.setsockopt(zmq.RCVHWM, config.replay.rcvhwm)
            router.bind(config.replay_endpoint)
            self.replays = ReplayServer(router, self, self._topic, config.replay)
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
        if self._joined():  # one resync for however many joined since the last tick
            self.resync(fresh=True)
        self._flush(force=False)
        if time.monotonic() - self._last_publish >= self.config.heartbeat_s:
            self._publish([])
        if self.replays is not None:
            self.replays.answer()

    def _joined(self, most: int = 64) -> bool:
        """Whether a subscriber joined since the last tick (the XPUB's queue of (un)subscribe
        messages, `\\x01topic` / `\\x00topic`, drained; at most `most` a tick)."""
        joined = False
        for _ in range(most):
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            joined = joined or msg[:1] == b"\x01"
        return joined

    def _flush(self, force: bool) -> None:
        events = self._storage_events()
        now = time.monotonic()
        if self.residency.changed and (force or now - self._last_walk >= self.config.interval_s):
            self._last_walk = now
            events += self.residency.changes()
        if events:
            self._publish(self._to_wire(events))

    # -- L3/L4 ----------------------------------------------------------------------------

    def _storage_events(self) -> list[TierEvent]:
        if self.storage is None:
            return []
        batch = self.storage.take_events()
        if batch.gap:
            self._synced = False
        if self._synced:
            return self.mirror.apply(batch.events)
        out = self._resync_storage()
        if not self._synced:
            return out
        # Events taken before the contents and while waiting for them: those numbered
        # after the contents' seq are newer than it.
        later = self.storage.take_events()
        self._synced = not later.gap
        return out + self.mirror.apply(batch.events + later.events)

    def _resync_storage(self) -> list[TierEvent]:
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

    # -- to the wire ------------------------------------------------------------------------

    def _ownership(self, tier: str) -> str | None:
        shared = tier == Tier.REMOTE or (tier == Tier.DISK and self.config.shared_disk)
        return self.config.pool if shared else None

    def _to_wire(self, events: list[TierEvent]) -> list[wire.Event]:
        """Our tier events as vLLM's, with the public/private naming of privacy.py."""
        out: list[wire.Event] = []
        for e in self.public.filter(events):
            medium, owner = wire.MEDIUM[e.tier], self._ownership(e.tier)
            held = self.published[e.tier]
            if isinstance(e, BlockStored):
                stored = self.public.stored(e, self.page_size, medium, owner)
                held.update(stored.block_hashes)
                out.append(stored)
            else:
                gone = (held.copy() if isinstance(e, AllBlocksCleared)
                        else {self.public.name(h) for h in e.block_hashes} & held)  # fmt: skip
                held.difference_update(gone)
                if gone:
                    out.append(wire.BlockRemoved(tuple(sorted(gone)), medium, owner))
        if len(self.public) > self.public.prune_at:
            self._prune()
        return out

    def _publish(self, events: list[wire.Event]) -> None:
        self._last_publish = time.monotonic()
        for part in wire.split(events, self.config.replay.max_events) or [[]]:
            self.seq += 1
            payload = wire.encode(wire.KVEventBatch(time.time(), tuple(part)))
            self.buffer.append((self.seq, payload))
            try:
                self._pub.send_multipart([self._topic, wire.seq_frame(self.seq), payload],
                                         zmq.NOBLOCK)  # fmt: skip
            except zmq.Again:  # PUB never blocks; a full subscriber loses the batch (a gap)
                log.debug("KV event batch %d dropped", self.seq)

    def resync(self, fresh: bool = False) -> int:
        """Publish every tier's contents from `AllBlocksCleared` on (for replays: at most
        once per `min_interval_s`; `fresh`: now, for a subscriber that joined after the
        last one); returns the number of its first batch."""
        now = time.monotonic()
        last = self._resync_at
        recent = (
            not fresh and last is not None and now - last[0] < self.config.replay.min_interval_s
        )
        if recent and last is not None and self.buffer and self.buffer[0][0] <= last[1]:
            return last[1]  # still buffered: askers share it
        self._flush(force=True)
        events: list[TierEvent] = [*self.residency.snapshot(), *self.mirror.snapshot()]
        self.published = {t: set() for t in TIERS}
        wired: list[wire.Event] = [wire.AllBlocksCleared()]
        wired += [e for e in self._to_wire(events) if isinstance(e, wire.BlockStored)]
        first = self.seq + 1
        self._publish(wired)
        self._resync_at = (now, first)
        self.resyncs += 1
        return first

    def _prune(self) -> None:
        self.public.prune(self.residency.pages().union(*self.mirror.tiers.values()))

    def close(self) -> None:
        self._pub.close(linger=0)
        if self.replays is not None:
            self.replays.sock.close(linger=0)
        if self._guard is not None:
            self._guard.close()
