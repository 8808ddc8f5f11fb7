"""Tier sizing, and the flags each setup gives `asynchicache serve` (parsed by its own parser)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynchicache.bench.workloads.setups import (
    SETUPS,
    ServerPlan,
    pick_setups,
    server_flags,
    size_tiers,
)
from asynchicache.hierarchy.pools import KVLayout
from asynchicache.launch.options import LaunchConfig, build_parser, to_config

KV_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # the default model in float32
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)


def test_size_tiers_working_set_four_times_l1_and_l2_twice_l1() -> None:
    s = size_tiers(working_set_tokens=8000, largest_request_tokens=700, page_size=16)
    assert s.device_cache_tokens == 2000 and s.host_cache_tokens == 4000
    assert s.working_set_over_l1 == pytest.approx(4.0)
    # Rounded up to whole pages.
    s = size_tiers(8001, 100, 16)
    assert s.device_cache_tokens % 16 == 0 and s.device_cache_tokens >= 2000.25


def test_size_tiers_l1_holds_the_largest_request() -> None:
    s = size_tiers(working_set_tokens=1000, largest_request_tokens=900, page_size=16)
    assert s.device_cache_tokens == 912 + 32  # the request, rounded to pages, plus two
    assert s.working_set_over_l1 < 4


def _config(flags: list[str]) -> LaunchConfig:
    return to_config(build_parser().parse_args([*flags, "--port", "8000", "--device", "cpu"]))


@pytest.mark.parametrize("slug", ["no-cache", "l1", "l1-l2", "l1-l2-l3", "l1-l2-l3-l4"])
def test_flags_turn_on_exactly_the_named_tiers(slug: str, tmp_path: Path) -> None:
    sizing = size_tiers(8000, 700, 16)
    plan = ServerPlan(sizing, KV_PER_TOKEN, tmp_path, "redis://127.0.0.1:6399/0")
    setup = SETUPS[slug]
    cfg = _config(server_flags(setup, plan))
    cache = cfg.cache
    assert cache.enable_prefix_cache == setup.prefix_cache
    assert cache.host_enabled == setup.host
    assert cache.disk_enabled == setup.disk
    assert (cache.remote_url is not None) == setup.remote
    assert cache.device_cache_tokens == 2000 and cache.page_size == 16
    if setup.host:
        # The host pool the engine builds holds exactly the planned tokens.
        slots = LAYOUT.pages_in(cache.host_cache_gb * 2**30)
        assert slots * 16 == sizing.host_cache_tokens
    if setup.disk:
        assert cache.disk_cache_dir == tmp_path


def test_pick_setups() -> None:
    assert [s.slug for s in pick_setups(None, None)] == ["no-cache", "l1", "l1-l2", "l1-l2-l3"]
    assert pick_setups(None, "redis://x")[-1].slug == "l1-l2-l3-l4"
    assert [s.name for s in pick_setups(["l1", "l1-l2-l3"], None)] == ["L1", "L1+L2+L3"]
    with pytest.raises(ValueError, match="known"):
        pick_setups(["l2"], None)
    with pytest.raises(ValueError, match="remote-url"):
        pick_setups(["l1-l2-l3-l4"], None)
