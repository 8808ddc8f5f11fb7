"""`Upkeep`: what the engine loop does between steps besides serving requests.

* publish KV events (kv_events/publisher.py), when `--kv-events-endpoint` is set;
* refresh the pins L2 honours from the cache service's listing (every server on
  the disk folder may pin), while idle, with a short bounded wait.
"""

from __future__ import annotations

import time

import zmq

from asynchicache.engine.engine import Engine
from asynchicache.kv_events.publisher import KvEventPublisher, KvEventsConfig
from asynchicache.storage.client.storage_client import StorageClient

PIN_REFRESH_S = 10.0
PIN_REFRESH_TIMEOUT_S = 0.2


class Upkeep:
    def __init__(self, engine: Engine, publisher: KvEventPublisher | None = None) -> None:
        self.engine = engine
        self.publisher = publisher
        self._pins_at = time.monotonic() - PIN_REFRESH_S + 1.0  # first refresh ~1 s in

    @classmethod
    def start(cls, engine: Engine, events: KvEventsConfig | None, ctx: zmq.Context) -> Upkeep:
        """The engine process's upkeep: a publisher when KV events are asked for, relaying
        the cache service's (its client subscribed with `ClientConfig.events`)."""
        if events is None:
            return cls(engine)
        storage = engine.cache.storage
        relay = storage if isinstance(storage, StorageClient) else None
        return cls(engine, KvEventPublisher(events, engine.cache, ctx, relay))

    def tick(self) -> None:
        if self.publisher is not None:
            self.publisher.tick()
        now = time.monotonic()
        if not self.engine.has_work and now - self._pins_at >= PIN_REFRESH_S:
            self._pins_at = now
            self.engine.admin_ops.refresh_pins(timeout_s=PIN_REFRESH_TIMEOUT_S)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
