"""A KV event publisher over a real cache for the event tests: L1/L2 of a tiny layout,
optionally a disk tier behind a real cache service (in a thread, real files, real
sockets), the publisher's sockets in a private folder, and `put` / `quiet` / `truth`."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from asynchicache.common.keys import Namespace
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.kv_events.publisher import KvEventPublisher, KvEventsConfig
from asynchicache.kv_events.subscriber import KvEventSubscriber
from asynchicache.settings.config import CacheConfig
from asynchicache.storage.base import PageLayout
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient
from asynchicache.storage.disk.disk_backend import DiskConfig
from asynchicache.storage.service.in_thread import client_in_thread
from asynchicache.storage.service.server import ServiceConfig

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("kv-events-test", "float32", PAGE)
PAGE_LAYOUT = PageLayout("float32", LAYOUT.page_shape)


def page_tokens(*page_ids: int) -> list[int]:
    return [k * 100 + i for k in page_ids for i in range(PAGE)]


@dataclass
class Rig:
    cache: HiRadixCache
    client: StorageClient | None
    publisher: KvEventPublisher
    endpoint: str
    replay: str

    def put(self, *page_ids: int, salt: str = "") -> None:
        self.put_tokens(page_tokens(*page_ids), salt)

    def put_tokens(self, tokens: list[int], salt: str = "") -> None:
        self.cache.drain(timeout_s=30)  # write-throughs hold their L1 pages
        pages = self.cache.allocate(len(tokens) // PAGE)
        assert pages is not None
        self.cache.unlock(self.cache.insert(tokens, pages, salt=salt).handle)
        self.cache.drain(timeout_s=30)

    def quiet(self, sub: KvEventSubscriber) -> None:
        """Publish until the service has nothing more to say, and let `sub` take it all."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.cache.drain(timeout_s=30)
            self.publisher.tick()
            reply = self.client.contents(("disk",)) if self.client is not None else None
            sub.poll(50)
            if reply is None or reply.seq == self.publisher.mirror.floor:
                self.publisher._flush(force=True)
                self.publisher.tick()
                sub.poll(200)
                if sub.synced and sub.last == self.publisher.seq:
                    return
        raise AssertionError("the events never caught up")

    def truth(self) -> dict[str, int]:
        stats = self.cache.stats()
        assert stats.host is not None and self.client is not None
        disk = self.client.stats()
        assert disk is not None and disk.disk is not None
        return {"device": stats.device.cached, "host": stats.host.cached,
                "disk": disk.disk.pages, "remote": 0}  # fmt: skip


@contextmanager
def kv_rig(
    tmp_path: Path,
    device_pages: int = 6,
    host_pages: int = 8,
    disk_pages: int | None = 12,
    **events: Any,
) -> Iterator[Rig]:
    """A rig with a disk tier of `disk_pages` page files (None: no disk tier, no service);
    `events` go to `KvEventsConfig` (endpoints default to ipc:// in a private folder)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ake-"))
    pool = HostPool.create(LAYOUT, host_pages)
    client = None
    if disk_pages is not None:
        file_bytes = DiskConfig(tmp_path / "kv", NS.encode(), PAGE_LAYOUT, 1).page_file_bytes
        service = ServiceConfig(tmp_path / "kv", address=f"ipc://{sock_dir}/svc.sock",
                                workers=1, io_threads=2,
                                disk_cache_bytes=disk_pages * file_bytes)  # fmt: skip
        client = client_in_thread(
            service, ClientConfig("", NS.encode(), pool.name, PAGE_LAYOUT, events=True)
        )
    cfg = CacheConfig(page_size=PAGE, device_cache_tokens=device_pages * PAGE,
                      host_cache_gb=host_pages * LAYOUT.page_bytes / 2**30,
                      disk_cache_dir=tmp_path / "kv" if client else None)  # fmt: skip
    cache = HiRadixCache(cfg, LAYOUT, NS, torch.device("cpu"), client, host_pool=pool)
    ctx = zmq.Context()
    events.setdefault("endpoint", f"ipc://{sock_dir}/ev.sock")
    events.setdefault("replay_endpoint", f"ipc://{sock_dir}/replay.sock")
    publisher = None
    try:
        publisher = KvEventPublisher(KvEventsConfig(**events), cache, ctx, client)
        assert client is None or client.wait_ready(20)
        yield Rig(cache, client, publisher, events["endpoint"], events["replay_endpoint"])
    finally:
        if publisher is not None:
            publisher.close()
        ctx.term()
        cache.close()
        if client is not None:
            client.close()
        pool.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
