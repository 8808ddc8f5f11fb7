"""Prometheus metrics: request latencies measured here, cache counters from the engine.

Two sources, one registry per app (no global registry, so several apps can
live in one process, e.g. in tests):

* `RequestMetrics`: histograms of time to first token, end-to-end latency and
  inter-token latency, and token counters, observed in the HTTP process.
* `EngineStatsCollector`: a custom Collector that exports the engine's
  `AdminReply("stats")` payload. `/metrics` fetches a fresh payload, hands it
  to the collector, then renders; nothing is scraped from inside `collect()`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asynchicache.engine.protocol import CachedTokens

PREFIX = "asynchicache"
TIERS = ("device", "host", "disk", "remote")

# Latency buckets from 1 ms (a cached prefix on a GPU) to minutes (a long cold
# prompt on a small CPU).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300
)  # fmt: skip
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class RequestMetrics:
    """What the HTTP process measures about each request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            registry=registry,
            buckets=_ITL_BUCKETS,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished generation requests by endpoint and finish reason.",
            ["endpoint", "finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens.", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens served from a cache tier instead of recomputed.",
            ["tier"],
            registry=registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight", "Generation requests being served.", registry=registry
        )
        for tier in TIERS:  # export zeros from the start, so rate() has a baseline
            self.cached_prompt_tokens.labels(tier)

    def finished(
        self, endpoint: str, reason: str, prompt: int, completion: int, cached: CachedTokens
    ) -> None:
        self.requests.labels(endpoint, reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        for tier in TIERS:
            self.cached_prompt_tokens.labels(tier).inc(getattr(cached, tier))


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
# Leaves whose name says they only grow are exported as counters.
_COUNTER_WORDS = re.compile(
    r"(hit|miss|evict|read|written|write|stored|loaded|bytes|count|failures|errors|"
    r"corrupt|preemptions|tokens|total|seconds|pages_in|pages_out)"
)
_GAUGE_WORDS = re.compile(r"(used|free|capacity|occupancy|in_use|cached|locked|estimate|queue|"
                          r"waiting|running|loading|pages$|bytes_used|size|available)")  # fmt: skip


def _clean(part: str) -> str:
    return _NAME_BAD.sub("_", part).strip("_").lower()


def flatten(payload: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    """Numeric leaves of a nested stats payload, with their key paths."""
    if isinstance(payload, int | float):  # bools too (a bool is an int): 0/1
        yield path, float(payload)
    elif isinstance(payload, Mapping):
        for key, value in payload.items():
            yield from flatten(value, (*path, str(key)))


def _split_labels(path: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """`("cache", "tiers", "disk", "hit_tokens")` -> name `cache_tiers_hit_tokens`, tier=disk.

    A tier name anywhere in the path becomes the `tier` label; a key under a
    `transfers` mapping becomes the `kind` label, so all tiers and all kinds
    of transfer share one metric family each.
    """
    labels: dict[str, str] = {}
    parts: list[str] = []
    for i, part in enumerate(path):
        if part in TIERS and "tier" not in labels:
            labels["tier"] = part
        elif i > 0 and path[i - 1] == "transfers" and "kind" not in labels:
            labels["kind"] = part
        else:
            parts.append(_clean(part))
    return "_".join(p for p in parts if p), labels


def _is_counter(name: str) -> bool:
    last = name.rsplit("_", 2)
    tail = "_".join(last[-2:])
    return bool(_COUNTER_WORDS.search(tail)) and not _GAUGE_WORDS.search(tail)


class EngineStatsCollector(Collector):
    """Exports the latest engine stats payload as metric families."""

    def __init__(self) -> None:
        self._payload: Mapping[str, Any] = {}
        self.scrape_ok = False

    def update(self, payload: Mapping[str, Any] | None) -> None:
        self.scrape_ok = payload is not None
        self._payload = payload or {}

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_engine_up", "1 when the engine answered this scrape.")
        up.add_metric([], 1.0 if self.scrape_ok else 0.0)
        yield up
        families: dict[str, Metric] = {}
        for path, value in flatten(self._payload):
            name, labels = _split_labels(path)
            if not name:
                continue
            family = families.get(name)
            if family is None:
                family = self._family(name, sorted(labels))
                families[name] = family
            family.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()

    @staticmethod
    def _family(name: str, label_names: list[str]) -> Metric:
        full = f"{PREFIX}_engine_{name}"
        doc = f"Engine stats field {name.replace('_', ' ')}."
        if _is_counter(name):
            return CounterMetricFamily(full.removesuffix("_total"), doc, labels=label_names)
        return GaugeMetricFamily(full, doc, labels=label_names)


class ServerMetrics:
    """The registry of one app: request metrics plus the engine stats collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)

    def render(self, engine_payload: Mapping[str, Any] | None) -> bytes:
        self.engine.update(engine_payload)
        return generate_latest(self.registry)
