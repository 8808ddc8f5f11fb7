"""The engine's stats payload as Prometheus families, rendered at each scrape.

`/metrics` fetches a fresh `AdminReply("stats")` payload, hands it to
`EngineStatsCollector`, then renders; nothing is scraped from inside `collect()`.
Known fields get their own names and labels (`_RULE_TABLE`); any other numeric field
is still exported, as a gauge named after its path. Also from the payload: each
tier's hit rate and occupancy, and the transfer latency histograms of
hierarchy/l2/latency.py (`asynchicache_cache_load_seconds`, `..._store_seconds`, per tier).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

PREFIX = "asynchicache"
HIT_TIERS = ("device", "host", "storage")  # the cache's own counters: storage = L3 and L4
# Paths the generic export leaves alone: they have families of their own.
_OWN_FAMILIES = ("cache.latency",)

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
counter prompt_logits_hits prompt_logits\.hits
    First tokens drawn from a kept prompt's last-position logits, before any forward.
counter prompt_logits_stored prompt_logits\.stored
    Prompts whose last-position logits were kept (engine/sampling/prompt_logits.py).
gauge prompt_logits prompt_logits\.(?P<what>entries|bytes)
    Prompts whose last-position logits are kept, and their bytes.
"""


Family = CounterMetricFamily | GaugeMetricFamily  # what a rule of the table makes


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
    elif isinstance(payload, Mapping) and ".".join(path) not in _OWN_FAMILIES:
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


def _hit_rates(payload: Mapping[str, Any]) -> Iterator[Metric]:
    """Each tier's share of the prompt tokens looked up, since the engine started."""
    counters = _counters(payload)
    family = GaugeMetricFamily(
        f"{PREFIX}_cache_hit_rate",
        "Share of looked-up prompt tokens each tier served since start (storage: L3 and L4; "
        "tier=all: any tier).",
        labels=["tier"],
    )
    looked_up = counters.get("match_tokens", 0)
    hits = {tier: counters.get(f"{tier}_hit_tokens", 0) for tier in HIT_TIERS}
    for tier, n in (*hits.items(), ("all", sum(hits.values()))):
        family.add_metric([tier], n / looked_up if looked_up else 0.0)
    yield family


def _counters(payload: Mapping[str, Any]) -> Mapping[str, Any]:
    cache = payload.get("cache")
    counters = cache.get("counters") if isinstance(cache, Mapping) else None
    return counters if isinstance(counters, Mapping) else {}


def _latencies(payload: Mapping[str, Any]) -> Iterator[Metric]:
    """hierarchy/l2/latency.py's histograms: load and store durations per tier."""
    cache = payload.get("cache")
    latency = cache.get("latency") if isinstance(cache, Mapping) else None
    for op, doc in (("load", "Durations of prefix loads (and arrival prefetches) up the "
                    "tiers, by the lowest tier read."),
                    ("store", "Durations of copies down the tiers: host = L1 -> L2, "
                     "disk = L2 -> L3.")):  # fmt: skip
        family = HistogramMetricFamily(f"{PREFIX}_cache_{op}_seconds", doc, labels=["tier"])
        tiers = latency.get(op, {}) if isinstance(latency, Mapping) else {}
        for tier, h in tiers.items():
            bounds, counts = h["buckets"], h["counts"]
            cumulative, running = [], 0
            for bound, count in zip([*bounds, float("inf")], counts, strict=True):
                running += count
                cumulative.append((_le(bound), running))
            family.add_metric([tier], cumulative, sum_value=h["sum"])
        yield family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


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
        yield from _hit_rates(self._payload)
        yield from _latencies(self._payload)
        families: dict[str, Family] = {}
        for path, value in flatten(self._payload):
            family, labels = self._family_for(path, families)
            family.add_metric(labels, value)
        yield from families.values()

    @staticmethod
    def _family_for(path: str, families: dict[str, Family]) -> tuple[Family, list[str]]:
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
