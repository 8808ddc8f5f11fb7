"""vLLM's and SGLang's metric names for what we measure too, so their dashboards show us.

`PEER_METRICS` is the table: the name as they spell it (counters without `_total`, as
their code names them), its type and labels as vLLM 0.32's `vllm/v1/metrics/loggers.py`
and SGLang's metrics collector declare them, and what it counts here. vLLM's labels are
`model_name` (the served name) and `engine` ("0": one engine per server), plus the
row's own; none carries a salt, a prompt or a token id. docs/migrating.md is generated
from the table (launch/migrating.py) and tests/vllm/test_bench_serve.py checks it
against vLLM's module and a live `/metrics`.

Two sources: what the HTTP process sees of each request (`PeerRequestMetrics`, fed
by server/metrics.py), and the engine's stats payload at each scrape
(`PeerEngineCollector`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asynchicache.engine.protocol import CachedTokens

VLLM_LABELS = ("model_name", "engine")
SGLANG_LABELS = ("model_name",)
ENGINE_INDEX = "0"
# vLLM's bucket families (vllm/v1/metrics/buckets.py), so their heatmaps line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's "source" of cached prompt tokens (CacheHitSource) for each of our tiers.
VLLM_SOURCE = {"device": "device", "host": "host", "disk": "disk", "remote": "external_unspecified"}


@dataclass(frozen=True)
class PeerMetric:
    """One metric of another server that this one exports under the same name."""

    peer: str
    name: str
    kind: str  # counter, gauge or histogram
    labels: tuple[str, ...]
    ours: str  # what it counts here


def _v(name: str, kind: str, ours: str, *extra: str) -> PeerMetric:
    return PeerMetric("vLLM", name, kind, (*VLLM_LABELS, *extra), ours)


def _s(name: str, kind: str, ours: str) -> PeerMetric:
    return PeerMetric("SGLang", name, kind, SGLANG_LABELS, ours)


PEER_METRICS = (
    _v("vllm:time_to_first_token_seconds", "histogram",
       "arrival at the HTTP server to the first token (asynchicache_time_to_first_token_seconds)"),
    _v("vllm:inter_token_latency_seconds", "histogram",
       "gap between consecutive tokens of a request (asynchicache_inter_token_latency_seconds)"),
    _v("vllm:e2e_request_latency_seconds", "histogram", "arrival to the last token"),
    _v("vllm:request_prompt_tokens", "histogram", "prompt tokens of each finished request"),
    _v("vllm:request_generation_tokens", "histogram", "tokens generated for each request"),
    _v("vllm:prompt_tokens", "counter", "prompt tokens of finished requests"),
    _v("vllm:generation_tokens", "counter", "generated tokens"),
    _v("vllm:request_success", "counter", "finished requests by reason (stop, length, abort, "
       "error)", "finished_reason"),
    _v("vllm:prompt_tokens_cached", "counter", "prompt tokens served from any tier"),
    _v("vllm:prompt_tokens_cached_by_source", "counter", "...by tier: device (L1), host (L2), "
       "disk (L3), external_unspecified (L4, Redis/Valkey)", "source"),
    _v("vllm:prompt_tokens_by_source", "counter", "local_compute (recomputed), local_cache_hit "
       "(L1), external_kv_transfer (L2, L3, L4)", "source"),
    _v("vllm:num_requests_running", "gauge", "requests in the running batch"),
    _v("vllm:num_requests_waiting", "gauge", "requests queued or loading their prefix"),
    _v("vllm:kv_cache_usage_perc", "gauge", "used share of L1 (1 = full)"),
    _v("vllm:prefix_cache_queries", "counter", "prompt tokens looked up in the cache"),
    _v("vllm:prefix_cache_hits", "counter", "...of which L1 held (vLLM's local prefix cache)"),
    _v("vllm:external_prefix_cache_queries", "counter", "prompt tokens looked up (every lookup "
       "reaches the lower tiers)"),
    _v("vllm:external_prefix_cache_hits", "counter", "...of which L2, L3 or L4 held"),
    _v("vllm:num_preemptions", "counter", "requests preempted for L1 room"),
    _s("sglang:cache_hit_rate", "gauge", "share of looked-up prompt tokens any tier held, since "
       "start (asynchicache_cache_hit_rate{tier=\"all\"})"),
    _s("sglang:num_running_reqs", "gauge", "requests in the running batch"),
    _s("sglang:num_queue_reqs", "gauge", "requests queued or loading their prefix"),
    _s("sglang:token_usage", "gauge", "used share of L1"),
    _s("sglang:prefetched_tokens", "counter", "tokens read from L3/L4 into L2 (loads and arrival "
       "prefetches)"),
    _s("sglang:backuped_tokens", "counter", "tokens stored from L2 to L3"),
)  # fmt: skip


def _request_token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's request_tokens family)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


class PeerRequestMetrics:
    """vLLM's per-request histograms and counters, observed in the HTTP process."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int = 1 << 20) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, registry=registry, buckets=buckets)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, (*VLLM_LABELS, *extra), registry=registry)

        self.labels: tuple[str, str] = ("model", ENGINE_INDEX)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first "
                         "token in seconds.", TTFT_BUCKETS)  # fmt: skip
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        tokens = _request_token_buckets(max_model_len)
        self.prompt_len = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.output_len = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation = counter("vllm:generation_tokens", "Number of generation tokens "
                                  "processed.")  # fmt: skip
        self.success = counter("vllm:request_success", "Count of successfully processed "
                               "requests.", "finished_reason")  # fmt: skip
        self.cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        self.cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            "source",
        )
        self.by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source"
        )

    def bind(self, model_name: str) -> None:
        """Label every series with the served model's name; zeros exported from the start
        (a router's scorers, and dashboards, find every series before the first request)."""
        self.labels = (model_name, ENGINE_INDEX)
        for metric in (self.ttft, self.itl, self.e2e, self.prompt_len, self.output_len,
                       self.prompt, self.generation, self.cached):  # fmt: skip
            metric.labels(*self.labels)
        for source in VLLM_SOURCE.values():
            self.cached_by_source.labels(*self.labels, source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.by_source.labels(*self.labels, source)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(*self.labels, reason)

    def finished(self, reason: str, prompt: int, completion: int, cached: CachedTokens) -> None:
        labels = self.labels
        self.success.labels(*labels, reason).inc()
        self.prompt.labels(*labels).inc(prompt)
        self.generation.labels(*labels).inc(completion)
        self.prompt_len.labels(*labels).observe(prompt)
        self.output_len.labels(*labels).observe(completion)
        self.cached.labels(*labels).inc(cached.total)
        for tier, source in VLLM_SOURCE.items():
            self.cached_by_source.labels(*labels, source).inc(getattr(cached, tier))
        external = cached.host + cached.disk + cached.remote
        self.by_source.labels(*labels, "local_cache_hit").inc(cached.device)
        self.by_source.labels(*labels, "external_kv_transfer").inc(external)
        self.by_source.labels(*labels, "local_compute").inc(max(0, prompt - cached.total))


def _number(payload: Mapping[str, Any], *path: str) -> float:
    node: Any = payload
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return float(node) if isinstance(node, int | float) else 0.0


class PeerEngineCollector(Collector):
    """vLLM's and SGLang's engine-side families, from the engine stats payload."""

    def __init__(self) -> None:
        self.payload: Mapping[str, Any] = {}
        self.model_name = "model"
        self.page_size = 16

    def collect(self) -> Iterator[Metric]:
        p = self.payload
        vllm = [self.model_name, ENGINE_INDEX]
        sglang = [self.model_name]
        running = _number(p, "queues", "running")
        waiting = _number(p, "queues", "waiting") + _number(p, "queues", "loading")
        total = _number(p, "cache", "device", "total")
        usage = (total - _number(p, "cache", "device", "free")) / total if total else 0.0
        c = ("cache", "counters")
        queries = _number(p, *c, "match_tokens")
        device = _number(p, *c, "device_hit_tokens")
        lower = _number(p, *c, "host_hit_tokens") + _number(p, *c, "storage_hit_tokens")
        ps = self.page_size
        for row in PEER_METRICS:
            value = {
                "vllm:num_requests_running": running,
                "vllm:num_requests_waiting": waiting,
                "vllm:kv_cache_usage_perc": usage,
                "vllm:prefix_cache_queries": queries,
                "vllm:prefix_cache_hits": device,
                "vllm:external_prefix_cache_queries": queries,
                "vllm:external_prefix_cache_hits": lower,
                "vllm:num_preemptions": _number(p, "preemptions"),
                "sglang:cache_hit_rate": (device + lower) / queries if queries else 0.0,
                "sglang:num_running_reqs": running,
                "sglang:num_queue_reqs": waiting,
                "sglang:token_usage": usage,
                "sglang:prefetched_tokens": _number(p, *c, "storage_to_host_pages") * ps,
                "sglang:backuped_tokens": _number(p, *c, "host_to_storage_pages") * ps,
            }.get(row.name)
            if value is None:
                continue  # an HTTP-side metric (PeerRequestMetrics)
            kind = CounterMetricFamily if row.kind == "counter" else GaugeMetricFamily
            family = kind(row.name, row.ours, labels=list(row.labels))
            family.add_metric(vllm if row.peer == "vLLM" else sglang, value)
            yield family
