"""The shared load-or-recompute rule (hierarchy/load_cost.py), as our engine and the vLLM
connector both apply it."""

from __future__ import annotations

from asynchicache.engine.scheduling.cost import CostModel
from asynchicache.hierarchy.load_cost import LoadCost, Rate

PAGE, PAGE_BYTES = 16, 1_000_000


def rule(prefill_tok_s: float = 1000.0, min_tokens: int = 0) -> LoadCost:
    # 1 page: 16 ms to recompute, 1 ms from host, 10 ms from disk
    bandwidth = {"host": Rate(1e9), "disk": Rate(1e8)}
    return LoadCost(PAGE_BYTES, PAGE, min_tokens, Rate(prefill_tok_s), bandwidth)


def test_a_load_pays_when_its_bytes_and_fixed_cost_take_less_than_recomputing() -> None:
    r = rule()
    assert r.pays({"host": 1}) and r.pays({"disk": 1})
    assert not r.pays({})  # nothing to load
    # A fixed 50 ms (a step's wait): 4 host pages save 60 ms, 3 save 45 ms.
    assert r.pays({"host": 4}, fixed_s=0.05) and not r.pays({"host": 3}, fixed_s=0.05)
    assert r.break_even_pages("host", 0.05) == 4
    # From disk each page saves 6 ms: 9 pages beat 50 ms, 8 do not.
    assert r.break_even_pages("disk", 0.05) == 9
    assert r.pays({"disk": 9}, 0.05) and not r.pays({"disk": 8}, 0.05)
    # A per-page extra as large as the saving: never pays.
    assert r.break_even_pages("disk", 0.0, per_page_s=0.006) is None


def test_min_load_tokens_and_a_fast_prefill_turn_loads_off() -> None:
    assert not rule(min_tokens=33).pays({"host": 2}) and rule(min_tokens=32).pays({"host": 2})
    assert rule(min_tokens=40).break_even_pages("host") == 3
    fast = rule(prefill_tok_s=1e6)  # recomputing a page takes 16 us
    assert not fast.pays({"disk": 100}) and fast.break_even_pages("disk") is None


def test_a_load_measures_the_slowest_tier_it_read() -> None:
    r = rule()
    r.observe_load({"host": 1}, 0.01)  # 1e8 B/s observed on host
    assert r.bandwidth["host"].value < 1e9 and r.bandwidth["disk"].value == 1e8
    r.observe_load({"host": 1, "disk": 1}, 0.04)  # 2 pages in 40 ms: disk's
    assert r.bandwidth["disk"].value == 1e8 + 0.2 * (5e7 - 1e8)
    fixed = Rate(7.0, weight=0.0)
    fixed.observe(1, 1)
    assert fixed.value == 7.0


def test_the_engines_cost_model_is_the_rule_over_its_rates() -> None:
    model = CostModel(PAGE_BYTES, PAGE, 0, Rate(1000.0), Rate(1e9), Rate(1e8))
    shared = rule()
    for host, storage in ((0, 0), (1, 0), (0, 3), (2, 5)):
        pages = {"host": host, "disk": storage}
        assert model.worth_loading(host, storage) == shared.pays(pages)
        assert model.load_seconds(host, storage) == shared.load_seconds(pages)
    model.observe_load(0, 2, 0.04)
    assert model.storage_Bps.value == 1e8 + 0.2 * (5e7 - 1e8)
    model.prefill_tok_s.observe(2000, 1.0)  # the rule reads the model's own rates
    assert model.rule.prefill_tok_s is model.prefill_tok_s
