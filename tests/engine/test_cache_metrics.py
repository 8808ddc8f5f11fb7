"""The ledger and quarantine figures of a real cache reach `/metrics` under their own names."""

from __future__ import annotations

from scheduler_rig import RigMaker, cached_prefix, tokens_for

from asynchicache.server.metrics import ServerMetrics

EXPORTED = (
    "asynchicache_cache_quarantined_slots 2.0",
    "asynchicache_cache_unsettled_tickets 1.0",
    'asynchicache_cache_ledger_pages{pool="slot",state="load_quarantined"} 2.0',
    'asynchicache_cache_ledger_pages{pool="page",state="free"} 8.0',
    "asynchicache_cache_illegal_transitions_total 0.0",
    'asynchicache_cache_events_total{what="slots_quarantined"} 2.0',
    "asynchicache_scheduler_loads_given_up_total 1.0",
    "asynchicache_prompt_logits_hits_total 3.0",
    "asynchicache_prompt_logits_stored_total 5.0",
    'asynchicache_prompt_logits{what="bytes"} 4096.0',
)


def test_quarantine_and_ledger_states_are_exported(make_rig: RigMaker) -> None:
    rig = make_rig(device_pages=8, host_slots=8, storage=True)
    cache, storage = rig.cache, rig.storage
    assert storage is not None
    tokens = tokens_for(1, 2)
    cached_prefix(rig, tokens)
    cache.clear()  # only in storage now
    storage.hold = True
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None
    storage.expire()  # the read times out while the "service" keeps it: 2 slots quarantined
    storage.hold = False
    cache.poll()
    assert ticket.handle is not None
    cache.unlock(ticket.handle)
    payload = {"cache": cache.stats().to_dict(), "queues": {"given_up_loads": 0},
               "loads_given_up": 1,
               "prompt_logits": {"entries": 2, "bytes": 4096, "hits": 3, "stored": 5}}  # fmt: skip
    text = ServerMetrics().render(payload).decode()
    assert [line for line in EXPORTED if line not in text] == []


def test_load_and_store_latency_per_tier_and_hit_rates(make_rig: RigMaker) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    rig = make_rig(device_pages=8, host_slots=8, storage=True)
    cache = rig.cache
    tokens = tokens_for(1, 2)
    cached_prefix(rig, tokens)  # L1 -> L2 copy, then L2 -> storage
    cache.clear()  # only in storage now
    ticket = cache.load(cache.match(tokens))
    assert ticket is not None
    cache.drain()
    cache.poll()
    cache.unlock(ticket.handle)  # type: ignore[arg-type]
    text = ServerMetrics().render({"cache": cache.stats().to_dict()}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {
        (name, s.labels["tier"]): s.value
        for name in ("asynchicache_cache_load_seconds", "asynchicache_cache_store_seconds")
        for s in families[name].samples
        if s.name.endswith("_count")
    }
    assert counts == {
        ("asynchicache_cache_load_seconds", "disk"): 1,
        ("asynchicache_cache_store_seconds", "host"): 1,
        ("asynchicache_cache_store_seconds", "disk"): 1,
    }
    rates = {s.labels["tier"]: s.value for s in families["asynchicache_cache_hit_rate"].samples}
    assert rates["storage"] == rates["all"] == 1.0  # the one lookup found every page in storage
    assert not [line for line in text.splitlines() if "engine_cache_latency" in line]
