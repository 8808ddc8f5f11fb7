"""`asynchicache fleet credits` against a real server with every tier (a real Redis for
L4): each tier below L1 is measured (it served the prompt alone), every credit lies in
[0, 1], and vllm-router starts with the flags it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import RedisServer, redis_server_binary
from serve_process import disk_server

from asynchicache.bench.fleet.fleet_router import Credits, RouterConfig, VllmRouter, Worker
from asynchicache.fleet.credits import (
    TIERS_BELOW,
    Probe,
    credits_of,
    llm_d_backends,
    llm_d_yaml,
    measure,
)


def test_llm_d_weights_name_every_medium_as_its_indexer_reads_them() -> None:
    """llm-d lowercases an event's medium and a weight list replaces its defaults whole."""
    import yaml

    credits = Credits(host=0.9, disk=0.41234, external=0.7)
    parsed = yaml.safe_load(llm_d_yaml(credits))
    assert parsed["indexerConfig"]["kvCacheBackendConfigs"] == llm_d_backends(credits) == [
        {"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.9},
        {"name": "disk", "weight": 0.412}, {"name": "external", "weight": 0.7},
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_credits_are_measured_for_every_tier_and_vllm_router_takes_them(
    tmp_path: Path,
) -> None:
    rds = RedisServer(redis_server_binary(), tmp_path / "redis").start()
    server = disk_server(tmp_path / "kv", tmp_path / "server.log", "--remote-url", rds.url,
                         "--host-cache-gb", "0.2", "--disk-cache-gb", "0.4")  # fmt: skip
    try:
        server.start()
        costs = measure(Probe(server.url, None, None), TIERS_BELOW, words=60, repeats=1)
        assert [c.tier for c in costs] == list(TIERS_BELOW)
        for c in costs:
            assert c.tokens >= 64 and c.compute_s_per_token > 0 and 0 <= c.credit <= 1, c
            # Every tier loads a token cheaper than it is computed (a credit above 0).
            assert c.load_s_per_token < c.compute_s_per_token, c
        credits = credits_of(costs)
        out = subprocess.run(
            [sys.executable, "-m", "asynchicache", "fleet", "credits", "--url", server.url,
             "--tiers", "host", "--repeats", "1", "--prompt-words", "40"],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        assert "--kv-penalty-host" in out and "--kv-penalty-external" in out, out
        assert "kvCacheBackendConfigs:" in out and "name: external" in out, out
        router = VllmRouter(RouterConfig(credits=credits), [Worker(server.url)],
                            tmp_path / "router.log")  # fmt: skip
        router.start()  # vllm-router validates the flags (0.0-1.0) at start
        router.stop()
    finally:
        server.shutdown()
        rds.stop()
