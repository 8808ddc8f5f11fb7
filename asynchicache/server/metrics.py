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
from dataclasses import dataclass
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
        def seconds(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}_seconds", doc, registry=registry, buckets=buckets)

        self.ttft = seconds(
            "time_to_first_token",
            "Time from request arrival to the first generated token.",
            _LATENCY_BUCKETS,
        )
        self.e2e = seconds(
            "e2e_request_latency", "Time from request arrival to its last token.", _LATENCY_BUCKETS
        )
        self.itl = seconds(
            "inter_token_latency",
            "Time between consecutive generated tokens of one request.",
            _ITL_BUCKETS,
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


@dataclass(frozen=True)
class _Rule:
    """Maps stats paths (dotted, matched whole) to one metric family; groups become labels."""

    pattern: re.Pattern[str]
    name: str
    counter: bool
    doc: str


# The engine's "stats" payload: {"cache": CacheStats.to_dict(), "queues": {...}, ...}.
# One rule a paragraph: "counter|gauge NAME PATTERN", then its help text (indented);
# the first rule whose pattern matches a path takes it.
_RULE_TABLE = r"""
counter cache_hit_tokens cache\.counters\.(?P<tier>\w+?)_hit_tokens
    Prompt tokens served from each tier instead of recomputed.
counter cache_lookup_tokens cache\.counters\.match_tokens
    Prompt tokens looked up in the cache.
counter cache_evicted_pages cache\.counters\.(?P<tier>\w+?)_evicted_pages
    Pages evicted from each tier.
counter cache_transfer_pages cache\.counters\.(?P<kind>\w+_to_\w+?)_pages
    Pages moved between tiers, by direction.
counter cache_transfer_bytes cache\.counters\.(?P<kind>\w+_to_\w+?)_bytes
    Bytes moved between tiers, by direction.
counter cache_transfer_seconds cache\.counters\.(?P<kind>\w+_to_\w+?)_seconds
    Time spent moving pages between tiers, by direction.
counter cache_failures cache\.counters\.(?P<kind>\w+?)_failures
    Failed transfers, stores and loads (each logged; the cache keeps going).
counter cache_illegal_transitions cache\.counters\.illegal_transitions
    Page or slot state changes the ledger refused (a bug; each is logged).
counter cache_events cache\.counters\.(?P<what>\w+)
    Other cache counters.
gauge cache_quarantined_slots cache\.quarantined_slots
    L2 slots a timed-out storage ticket may still touch (held until it settles).
gauge cache_unsettled_tickets cache\.unsettled_tickets
    Timed-out storage tickets whose slots wait for the service to settle them.
gauge cache_ledger_pages cache\.(?P<pool>page|slot)_states\.(?P<state>\w+)
    L1 pages (pool=page) and L2 slots (pool=slot) by ledger state.
gauge cache_pages cache\.(?P<tier>\w+)\.(?P<state>free|cached|in_use)
    Pages of each tier's pool by state (free + cached + in use == capacity).
gauge cache_capacity_pages cache\.(?P<tier>\w+)\.total
    Pages each tier's pool holds.
gauge cache_pending_operations cache\.pending_(?P<kind>\w+)
    Transfers and storage operations in flight.
counter storage_corrupt_pages_detected storage\.(?P<tier>disk|remote)\.corrupt_detected
    Stored pages that failed verification (removed, never served); per service run.
counter storage_store_failures storage\.(?P<tier>disk|remote)\.store_failures
    Pages a tier failed to store (full disk, I/O error, tier down); per service run.
gauge scheduler_queue_length queues\.(?P<queue>\w+)
    Requests in each scheduler queue.
counter scheduler_preemptions preemptions
    Requests preempted for memory.
counter scheduler_loads_given_up loads_given_up
    Prefix loads the scheduler stopped waiting for (deadline or abort); recomputed.
"""


def _parse_rules(table: str) -> tuple[_Rule, ...]:
    rules = []
    for head, doc in re.findall(r"^(\S.*)\n    (.+)$", table, re.MULTILINE):
        kind, name, pattern = head.split(" ")
        rules.append(_Rule(re.compile(pattern), name, kind == "counter", doc))
    return tuple(rules)


_RULES = _parse_rules(_RULE_TABLE)


def flatten(payload: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, float]]:
    """Numeric leaves of a nested stats payload, with their dotted paths."""
    if isinstance(payload, int | float):  # bools too (a bool is an int): 0/1
        yield ".".join(path), float(payload)
    elif isinstance(payload, Mapping):
        for key, value in payload.items():
            yield from flatten(value, (*path, str(key)))


def _occupancy(payload: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """(tier, used / capacity) for every pool in the cache stats."""
    cache = payload.get("cache")
    if not isinstance(cache, Mapping):
        return
    for tier, pool in cache.items():
        if isinstance(pool, Mapping) and pool.get("total"):
            yield tier, (pool["total"] - pool.get("free", 0)) / pool["total"]


class EngineStatsCollector(Collector):
    """Exports the latest engine stats payload as metric families.

    Known fields get their own names and labels (`_RULES`); any other numeric
    field is still exported, as a gauge named after its path, so a counter the
    engine adds later shows up without a change here.
    """

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
        occ = GaugeMetricFamily(
            f"{PREFIX}_cache_occupancy_ratio", "Used share of each tier's pool.", labels=["tier"]
        )
        for tier, ratio in _occupancy(self._payload):
            occ.add_metric([tier], ratio)
        yield occ
        families: dict[str, Metric] = {}
        for path, value in flatten(self._payload):
            family, labels = self._family_for(path, families)
            family.add_metric(labels, value)
        yield from families.values()

    @staticmethod
    def _family_for(path: str, families: dict[str, Metric]) -> tuple[Metric, list[str]]:
        for rule in _RULES:
            match = rule.pattern.fullmatch(path)
            if match is None:
                continue
            labels = match.groupdict()
            if rule.name not in families:
                kind = CounterMetricFamily if rule.counter else GaugeMetricFamily
                families[rule.name] = kind(f"{PREFIX}_{rule.name}", rule.doc, labels=list(labels))
            return families[rule.name], list(labels.values())
        name = "engine_" + _NAME_BAD.sub("_", path).lower()
        if name not in families:
            families[name] = GaugeMetricFamily(f"{PREFIX}_{name}", f"Engine stats field {path}.")
        return families[name], []


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
