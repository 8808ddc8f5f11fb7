"""KV events of every tier in one stream (engine/kv_events.py), with a real cache service
(in a thread, real files, real sockets): a subscriber rebuilds what each tier holds, a late
or disconnected one detects the gap and catches up from the replay socket."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zmq

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.keys import Namespace
from asynchicache.cache.pools import HostPool, KVLayout
from asynchicache.config import CacheConfig
from asynchicache.engine.kv_events import KvEventPublisher, KvEventsConfig
from asynchicache.engine.kv_subscriber import KvEventSubscriber
from asynchicache.storage.base import PageLayout
from asynchicache.storage.client import ClientConfig, StorageClient
from asynchicache.storage.disk import DiskConfig
from asynchicache.storage.service import ServiceConfig

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("kv-events-test", "float32", PAGE)
PAGE_LAYOUT = PageLayout("float32", LAYOUT.page_shape)
DISK_PAGES = 12  # the folder's capacity, in page files: the workload evicts


@dataclass
class Rig:
    cache: HiRadixCache
    client: StorageClient
    publisher: KvEventPublisher
    endpoint: str
    replay: str

    def put(self, *page_ids: int) -> None:
        tokens = [k * 100 + i for k in page_ids for i in range(PAGE)]
        self.cache.drain(timeout_s=30)  # write-throughs hold their L1 pages
        pages = self.cache.allocate(len(page_ids))
        assert pages is not None
        self.cache.unlock(self.cache.insert(tokens, pages).handle)
        self.cache.drain(timeout_s=30)

    def quiet(self, sub: KvEventSubscriber) -> None:
        """Publish until the service has nothing more to say, and let `sub` take it all."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.cache.drain(timeout_s=30)
            self.publisher.tick()
            reply = self.client.contents(("disk",))
            sub.poll(50)
            if reply is not None and reply.seq == self.publisher.mirror.floor:
                self.publisher._flush(force=True)
                self.publisher.tick()
                sub.poll(200)
                if sub.synced and sub.last == self.publisher.seq:
                    return
        raise AssertionError("the events never caught up")

    def truth(self) -> dict[str, int]:
        stats = self.cache.stats()
        disk = self.client.stats()
        assert disk is not None and disk.disk is not None
        assert stats.host is not None
        return {"device": stats.device.cached, "host": stats.host.cached,
                "disk": disk.disk.pages, "remote": 0}  # fmt: skip


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    sock_dir = Path(tempfile.mkdtemp(prefix="ake-"))
    pool = HostPool.create(LAYOUT, 8)
    file_bytes = DiskConfig(tmp_path / "kv", NS.encode(), PAGE_LAYOUT, 1).page_file_bytes
    service = ServiceConfig(tmp_path / "kv", address=f"ipc://{sock_dir}/svc.sock", workers=1,
                            io_threads=2, capacity_bytes=DISK_PAGES * file_bytes)  # fmt: skip
    client = StorageClient.in_thread(
        service, ClientConfig("", NS.encode(), pool.name, PAGE_LAYOUT, events=True)
    )
    cfg = CacheConfig(page_size=PAGE, device_cache_tokens=6 * PAGE,
                      host_cache_gb=8 * LAYOUT.page_bytes / 2**30,
                      disk_cache_dir=tmp_path / "kv")  # fmt: skip
    cache = HiRadixCache(cfg, LAYOUT, NS, torch.device("cpu"), client, host_pool=pool)
    ctx = zmq.Context()
    endpoint, replay = f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/replay.sock"
    publisher = KvEventPublisher(KvEventsConfig(endpoint, replay), cache, ctx, client)
    try:
        assert client.wait_ready(20)
        yield Rig(cache, client, publisher, endpoint, replay)
    finally:
        publisher.close()
        ctx.term()
        cache.close()
        client.close()
        pool.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_subscriber_rebuilds_every_tier(rig: Rig) -> None:
    sub = KvEventSubscriber(rig.endpoint, rig.replay)
    try:
        sub.request_replay()  # answered by the publisher's next tick
        for k in range(0, 30, 3):  # 30 pages through L1 of 6, L2 of 8, a disk of 12
            rig.put(k, k + 1, k + 2)
            rig.publisher.tick()
            sub.poll(0)
        rig.cache.clear_tiers(device=True, host=False)
        rig.put(0, 1)  # again: from the disk (a load) or computed anew
        rig.quiet(sub)
        truth = rig.truth()
        assert sub.counts() == truth, (sub.counts(), truth)
        assert truth["disk"] == DISK_PAGES and truth["host"] > 0 and truth["device"] > 0
        assert sub.gaps == 0 and sub.replays == 1
        on_disk = {h for h, _ in zip(rig.client.contents(("disk",)).disk_hashes, range(10**6),
                                     strict=False)}  # type: ignore[union-attr]  # fmt: skip
        assert sub.tiers["disk"] == on_disk
    finally:
        sub.close()


def test_a_gap_is_detected_and_the_replay_recovers(rig: Rig) -> None:
    sub = KvEventSubscriber(rig.endpoint, rig.replay)
    try:
        sub.request_replay()
        rig.put(1, 2)
        rig.quiet(sub)
        sub.disconnect()  # the router is away: what is published now is lost to it
        for k in range(10, 30, 2):
            rig.put(k, k + 1)
            rig.publisher.tick()
        sub.connect()
        time.sleep(0.3)  # the new subscription takes hold
        rig.put(40, 41)
        rig.quiet(sub)
        assert sub.gaps >= 1 and sub.replays >= 2, (sub.gaps, sub.replays)
        assert sub.counts() == rig.truth()
    finally:
        sub.close()
