"""A scheduler over a tiny cache and no model, for the page and lock accounting tests.

A "forward pass" here only advances the bookkeeping (`after_forward`), which is
all the page and lock accounting depends on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from storage_doubles import MemoryStorage

from asynchicache.common.keys import Namespace
from asynchicache.engine.scheduling.batch import Batch
from asynchicache.engine.scheduling.cost import CostModel
from asynchicache.engine.scheduling.scheduler import Scheduler
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.settings.config import CacheConfig, EngineConfig

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("scheduler-test-model", "float32", PAGE)


@dataclass
class Rig:
    cache: HiRadixCache
    scheduler: Scheduler
    storage: MemoryStorage | None

    def close(self) -> None:
        self.cache.close()
        if self.storage is not None and self.storage.pool is not None:
            self.storage.pool.close()


def make_rig(
    device_pages: int = 8,
    host_slots: int = 4,
    storage: bool = False,
    engine: EngineConfig | None = None,
    **cache: object,
) -> Rig:
    # Loads at admission unless a test asks for prefetch at arrival (test_arrival_prefetch.py).
    cache.setdefault("arrival_prefetch", False)
    config = CacheConfig(
        page_size=PAGE,
        device_cache_tokens=device_pages * PAGE,
        host_cache_gb=host_slots * LAYOUT.page_bytes / 2**30,
        disk_cache_dir=None,
        **cache,  # type: ignore[arg-type]
    )
    pool = HostPool.create(LAYOUT, host_slots) if storage else None
    store = MemoryStorage(pool) if storage else None
    hrc = HiRadixCache(config, LAYOUT, NS, torch.device("cpu"), store, host_pool=pool)
    cost = CostModel.initial(LAYOUT.page_bytes, PAGE, 0)
    scheduler = Scheduler(engine or EngineConfig(min_load_tokens=0), config, hrc, cost)
    return Rig(hrc, scheduler, store)


RigMaker = Callable[..., Rig]  # the `make_rig` fixture: `make_rig` above, closed after the test


def tokens_for(*ids: int) -> list[int]:
    return [k * 100 + i for k in ids for i in range(PAGE)]


def cached_prefix(rig: Rig, tokens: list[int]) -> None:
    """Put `tokens` in the cache (L1, then L2 and storage) as a finished request would."""
    pages = rig.cache.allocate(len(tokens) // PAGE)
    assert pages is not None
    rig.cache.unlock(rig.cache.insert(tokens, pages).handle)
    rig.cache.drain()


def step(rig: Rig) -> Batch:
    """One scheduler step with a model that always samples token 1; returns its batch."""
    batch = rig.scheduler.schedule()
    for req in rig.scheduler.after_forward(batch):
        req.output.append(1)
        if len(req.output) >= req.sampling.max_tokens:
            rig.scheduler.finish(req, "length")
    rig.scheduler.drain_finished()
    return batch


def run_until_idle(rig: Rig) -> None:
    deadline = time.monotonic() + 30
    while rig.scheduler.has_work:
        assert time.monotonic() < deadline, "the scheduler never went idle"
        step(rig)
        rig.cache.transfer.flush()


def assert_no_locks(cache: HiRadixCache) -> None:
    cache.check_integrity()
    for node in cache.tree.iter_nodes():
        assert node.lock_ref == 0, f"a lock nobody holds at {node}"
        assert node.host_ref == 0, f"a store hold left at {node}"
    assert cache.stats().device.in_use == 0
