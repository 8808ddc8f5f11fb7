"""The ledger and quarantine figures of a real cache reach `/metrics` under their own names."""

from __future__ import annotations

import torch
from storage_doubles import MemoryStorage

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.keys import Namespace
from asynchicache.cache.pools import HostPool, KVLayout
from asynchicache.config import CacheConfig
from asynchicache.server.metrics import ServerMetrics

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)


def test_quarantine_and_ledger_states_are_exported() -> None:
    config = CacheConfig(page_size=PAGE, device_cache_tokens=8 * PAGE, disk_cache_dir=None,
                         host_cache_gb=8 * LAYOUT.page_bytes / 2**30)  # fmt: skip
    pool = HostPool.create(LAYOUT, 8)
    storage = MemoryStorage(pool)
    cache = HiRadixCache(config, LAYOUT, Namespace("m", "float32", PAGE), torch.device("cpu"),
                         storage, host_pool=pool)  # fmt: skip
    try:
        tokens = list(range(2 * PAGE))
        pages = cache.allocate(2)
        assert pages is not None
        cache.unlock(cache.insert(tokens, pages).handle)
        cache.drain()
        cache.clear()
        storage.hold = True
        ticket = cache.load(cache.match(tokens))
        assert ticket is not None
        storage.expire()
        storage.hold = False
        cache.poll()
        assert ticket.handle is not None
        cache.unlock(ticket.handle)
        payload = {"cache": cache.stats().to_dict(), "queues": {"given_up_loads": 0},
                   "loads_given_up": 1}  # fmt: skip
        text = ServerMetrics().render(payload).decode()
    finally:
        cache.close()
        pool.close()
    assert "asynchicache_cache_quarantined_slots 2.0" in text
    assert "asynchicache_cache_unsettled_tickets 1.0" in text
    assert 'asynchicache_cache_ledger_pages{pool="slot",state="load_quarantined"} 2.0' in text
    assert 'asynchicache_cache_ledger_pages{pool="page",state="free"} 8.0' in text
    assert "asynchicache_cache_illegal_transitions_total 0.0" in text
    assert 'asynchicache_cache_events_total{what="slots_quarantined"} 2.0' in text
    assert "asynchicache_scheduler_loads_given_up_total 1.0" in text
