"""The scheduler over a tiny cache (no model): loads it gives up, collects and abandons.

A "forward pass" here only advances the bookkeeping (`after_forward`), which is
all the page and lock accounting depends on. Issue 11, defects 2, 3 and 7.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from storage_doubles import MemoryStorage

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.keys import Namespace
from asynchicache.cache.pools import HostPool, KVLayout
from asynchicache.config import CacheConfig, EngineConfig
from asynchicache.engine.cost import CostModel
from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Phase, Request
from asynchicache.engine.scheduler import Scheduler

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("scheduler-test-model", "float32", PAGE)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
LATE = {"prefetch_policy": "timeout", "prefetch_timeout_s": 1e-9}  # every load is late


@dataclass
class Rig:
    cache: HiRadixCache
    scheduler: Scheduler
    storage: MemoryStorage | None


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.cache.close()
        if rig.storage is not None and rig.storage.pool is not None:
            rig.storage.pool.close()


def make_rig(
    rigs: list[Rig], device_pages: int = 8, host_slots: int = 4, storage: bool = False,
    **cache: object,
) -> Rig:
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
    rig = Rig(hrc, Scheduler(EngineConfig(min_load_tokens=0), config, hrc, cost), store)
    rigs.append(rig)
    return rig


def tokens_for(*ids: int) -> list[int]:
    return [k * 100 + i for k in ids for i in range(PAGE)]


def cached_prefix(rig: Rig, tokens: list[int]) -> None:
    """Put `tokens` in the cache (L1, then L2 and storage) as a finished request would."""
    pages = rig.cache.allocate(len(tokens) // PAGE)
    assert pages is not None
    rig.cache.unlock(rig.cache.insert(tokens, pages).handle)
    rig.cache.drain()


def step(rig: Rig) -> None:
    """One scheduler step with a model that always samples token 1."""
    batch = rig.scheduler.schedule()
    for req in rig.scheduler.after_forward(batch):
        req.output.append(1)
        if len(req.output) >= req.sampling.max_tokens:
            rig.scheduler.finish(req, "length")
    rig.scheduler.drain_finished()


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


def test_a_landed_load_is_collected_before_late_loads_are_given_up(rigs: list[Rig]) -> None:
    rig = make_rig(rigs, **LATE)
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.evict(8)  # only in L2 now
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    rig.cache.transfer.flush()  # the load has landed; its deadline has passed too
    step(rig)
    assert req.cached.host == 3 * PAGE, "a load that had landed was thrown away"
    run_until_idle(rig)
    assert_no_locks(rig.cache)


def test_giving_up_a_load_whose_prefix_was_evicted_does_not_crash(rigs: list[Rig]) -> None:
    rig = make_rig(rigs, **LATE)
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.evict(8)  # only in L2 now
    busy = rig.cache.allocate(8)  # running requests hold all of L1: the load finds no room
    assert busy is not None
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    rig.cache.evict_host(4)  # L2 pressure (e.g. a write-through) takes the host-only prefix
    step(rig)  # the deadline has passed: the scheduler falls back on what L1 holds
    assert req.phase is Phase.RUNNING
    rig.cache.free(busy)
    run_until_idle(rig)
    assert req.finish_reason == "length"
    assert_no_locks(rig.cache)


def test_a_given_up_load_counts_as_work_until_it_lands_and_is_released(
    rigs: list[Rig],
) -> None:
    rig = make_rig(rigs, storage=True, **LATE)
    assert rig.storage is not None
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.clear()  # only in storage now
    rig.storage.hold = True
    rig.storage.cancellable = False  # the service has started the read: it will land
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    step(rig)  # late: given up, recomputed
    while req.phase is not Phase.FINISHED:
        step(rig)
    assert req.cached.disk == 0
    assert rig.scheduler.has_work, "a load still in flight is not counted as work"
    rig.storage.hold = False
    run_until_idle(rig)
    assert_no_locks(rig.cache)
    rig.cache.clear()
    stats = rig.cache.stats()
    assert stats.device.cached == 0 and stats.host is not None and stats.host.cached == 0


def test_an_aborted_loading_request_releases_everything(rigs: list[Rig]) -> None:
    rig = make_rig(rigs, storage=True)
    assert rig.storage is not None
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.clear()
    rig.storage.hold = True
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    assert rig.scheduler.abort("r")
    assert req.phase is Phase.FINISHED
    rig.storage.hold = False
    run_until_idle(rig)
    rig.cache.drain()
    assert_no_locks(rig.cache)
