"""vLLM's and SGLang's metric names on /metrics (server/compat_metrics.py), with the types
and labels the table gives them, next to ours; no label carries a salt, a prompt or a
token id. tests/vllm/test_bench_serve.py checks the table against vLLM's own module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY, ThreadServer

from asynchicache.launch.frontend import Frontend
from asynchicache.server.compat_metrics import PEER_METRICS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SALT = "tenant-salt-7f3a9"
PROMPT = "zanzibar quokka marmalade, a prompt nobody else sends. " * 4


@pytest.fixture(scope="module")
def scraped(fake_engine: Path, frontend: Frontend) -> Iterator[str]:
    srv = ThreadServer(fake_engine, frontend, API_KEY)
    srv.start()
    try:
        body = {"prompt": PROMPT, "max_tokens": 4, "cache_salt": SALT}
        for _ in range(2):  # the second one hits the fake engine's prefix cache
            r = httpx.post(srv.url + "/v1/completions", headers=AUTH, json=body, timeout=60)
            assert r.status_code == 200, r.text
        yield httpx.get(srv.url + "/metrics", headers=AUTH, timeout=30).text
    finally:
        srv.close()


def test_every_peer_metric_is_exported_with_its_type_and_labels(scraped: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    for row in PEER_METRICS:
        family = families.get(row.name)
        assert family is not None, f"{row.name} is not on /metrics"
        assert family.type == row.kind, row.name
        assert family.samples, row.name
        for sample in family.samples:
            extra = {"le"} if row.kind == "histogram" else set()
            assert set(sample.labels) - extra == set(row.labels), (row.name, sample.labels)
            assert sample.labels["model_name"] == "fake-model"
    assert families["vllm:prompt_tokens"].samples[0].value > 0
    ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")]  # fmt: skip
    assert ttft[0].value == 2
    assert families["sglang:cache_hit_rate"].samples[0].value > 0


def test_ours_carry_a_hit_rate_per_tier(scraped: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    rates = {s.labels["tier"]: s.value for s in families["asynchicache_cache_hit_rate"].samples}
    assert set(rates) == {"device", "host", "storage", "all"}
    assert 0 < rates["device"] == rates["all"] <= 1
    assert "asynchicache_cache_load_seconds" in families  # filled by a real cache (test below)


def test_no_label_carries_a_salt_a_prompt_or_token_ids(scraped: str, frontend: Frontend) -> None:
    ids = frontend.tokenizer.encode(PROMPT)
    for family in text_string_to_metric_families(scraped):
        for sample in family.samples:
            for value in sample.labels.values():
                assert SALT not in value and "zanzibar" not in value
                assert str(ids[:3])[1:-1] not in value


def test_routers_find_vllms_load_series_from_start_up(
    fake_engine: Path, frontend: Frontend
) -> None:
    """Issue 38: a router's queue and utilisation scorers read these from the first second,
    with vLLM's labels, before any request (labelled series used to appear only after one)."""
    srv = ThreadServer(fake_engine, frontend, API_KEY)
    srv.start()
    try:
        scraped = httpx.get(srv.url + "/metrics", headers=AUTH, timeout=30).text
    finally:
        srv.close()
    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    labels = {"model_name": "fake-model", "engine": "0"}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        samples = families[name].samples
        assert [(s.labels, s.value) for s in samples] == [(labels, 0.0)], name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens"):  # fmt: skip
        counts = [s for s in families[name].samples if s.name.endswith("_count")]
        assert [(s.labels, s.value) for s in counts] == [(labels, 0.0)], name
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prompt_tokens_cached"):
        assert [s.labels for s in families[name].samples if s.name.endswith("_total")] == [labels]
