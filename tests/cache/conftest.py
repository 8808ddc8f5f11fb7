"""Fixtures for the cache tests: caches that are always closed (helpers in cache_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cache_helpers import LAYOUT, NS, PAGE, MakeCache, MemoryStorage, host_gb

from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pools import HostPool
from asynchicache.settings.config import CacheConfig, WritePolicy


@pytest.fixture
def make_cache() -> Iterator[MakeCache]:
    """Build caches (closed at teardown): make_cache(device_pages=8, host_slots=8, ...).

    Their ledgers are strict (an illegal transition raises) unless `strict=False`.
    """
    made: list[tuple[HiRadixCache, HostPool | None]] = []

    def build(
        device_pages: int = 8,
        host_slots: int = 8,
        policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        with_storage: bool = False,
        strict: bool = True,
        **config: object,
    ) -> HiRadixCache:
        cfg = CacheConfig(
            page_size=PAGE,
            device_cache_tokens=device_pages * PAGE,
            host_cache_gb=host_gb(host_slots),
            enable_host_cache=host_slots > 0,
            write_policy=policy,
            disk_cache_dir=None,
            **config,  # type: ignore[arg-type]
        )
        pool = HostPool.create(LAYOUT, host_slots) if with_storage else None
        storage = MemoryStorage(pool) if pool is not None else None
        cache = HiRadixCache(
            cfg, LAYOUT, NS, torch.device("cpu"), storage, host_pool=pool, strict=strict
        )
        made.append((cache, pool))
        return cache

    yield build
    for cache, pool in made:
        cache.close()
        if pool is not None:
            pool.close()
