"""The hierarchy with the real storage client (its service in a thread, real disk files)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, NS, PAGE, host_gb, tokens_for

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.pools import HostPool
from asynchicache.config import CacheConfig
from asynchicache.storage.base import PageLayout
from asynchicache.storage.client import ClientConfig, StorageClient
from asynchicache.storage.service import ServiceConfig


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[HiRadixCache]:
    sock_dir = Path(tempfile.mkdtemp(prefix="acc-"))  # ipc paths must stay short
    pool = HostPool.create(LAYOUT, 8)
    service = ServiceConfig(
        tmp_path / "kv", address=f"ipc://{sock_dir}/svc.sock", workers=1, io_threads=2
    )
    page = PageLayout("float32", LAYOUT.page_shape)
    client = StorageClient.in_thread(service, ClientConfig("", NS.encode(), pool.name, page))
    cfg = CacheConfig(
        page_size=PAGE,
        device_cache_tokens=8 * PAGE,
        host_cache_gb=host_gb(8),
        disk_cache_dir=tmp_path / "kv",
    )
    cache = HiRadixCache(cfg, LAYOUT, NS, torch.device("cpu"), client, host_pool=pool)
    try:
        assert client.wait_ready(20)
        yield cache
    finally:
        cache.close()
        client.close()
        pool.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_pages_round_trip_through_the_disk_service(cache: HiRadixCache) -> None:
    tokens = tokens_for(1, 2, 3)
    pages = cache.allocate(3)
    assert pages is not None
    kv = torch.randn((3, *LAYOUT.page_shape))
    for i, p in enumerate(pages):
        cache.device_pool.tensor[p].copy_(kv[i])
    cache.unlock(cache.insert(tokens, pages).handle)
    cache.drain(timeout_s=30)
    assert cache.stats().counters.host_to_storage_pages == 3
    cache.clear()  # nothing left in L1 or L2
    assert cache.lookup(tokens) == {"device": 0, "host": 0, "storage": 3 * PAGE}
    match = cache.match(tokens)
    assert match.storage_hit_pages == 3
    ticket = cache.load(match)
    assert ticket is not None
    cache.drain(timeout_s=30)
    assert ticket.done and ticket.ok, ticket.error
    assert ticket.pages_from_storage == 3
    for i, p in enumerate(ticket.device_pages):
        assert torch.equal(cache.device_pool.tensor[p], kv[i])
    assert ticket.handle is not None
    cache.unlock(ticket.handle)
    cache.check_integrity()
