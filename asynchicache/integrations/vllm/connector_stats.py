"""The connector's counters: vLLM's connector stats (-> its logs and /metrics).

Both halves count: the scheduler side hit tokens per tier and what the cache
service moved, the worker side the bytes it copied between vLLM's blocks and
L2. vLLM sums the two each step (`aggregate`) and hands the sum to the
Prometheus logger in the API server process (`AsynchicachePromMetrics`).

    vllm:asynchicache_hit_tokens_total{tier="host|disk|remote"}
    vllm:asynchicache_hits_total{tier="host|disk|remote",size="le16|le64|le256|le1024|more"}
                                 (hits loaded, by their slowest tier and their tokens)
    vllm:asynchicache_bytes_total{direction="load|save"}    (L2 <-> vLLM's blocks)
    vllm:asynchicache_events_total{event="..."}             (lookups, failures, ...)
    vllm:asynchicache_refused_total{reason="..."}           (requests not cached, why)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from asynchicache.integrations.vllm.request_names import REFUSALS

TIERS = ("host", "disk", "remote")
# Hit sizes in tokens: up to 16 (the one shared page of a system prompt), 64, 256, 1024.
HIT_SIZES = ((16, "le16"), (64, "le64"), (256, "le256"), (1024, "le1024"))


def hit_size(tokens: int) -> str:
    """The size bucket of a hit of `tokens` tokens (`hits_<tier>_<bucket>`)."""
    return next((name for limit, name in HIT_SIZES if tokens <= limit), "more")


DIRECTIONS = ("load", "save")
EVENTS = (
    "lookups",
    "lookup_hits",
    "lookup_timeouts",
    "lookups_not_waited",
    "skipped_unprofitable",
    "service_unavailable",
    "prefetch_failures",
    "load_errors",
    "loads_skipped",
    "pages_stored",
    "store_failures",
    "saves_deferred",
    "saves_skipped",
    "save_errors",
)


@dataclass
class AsynchicacheStats(KVConnectorStats):
    """Counters since the last report; keys `hit_tokens_<tier>`, `bytes_<direction>`, events."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: float = 1.0) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> AsynchicacheStats:
        for name, value in other.data.items():
            if isinstance(value, int | float):
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> AsynchicacheStats | None:
        """The counters so far (None when nothing happened), and start afresh."""
        if self.is_empty():
            return None
        out = AsynchicacheStats(dict(self.data))
        self.reset()
        return out


class AsynchicachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        made = {
            "hit_tokens": ("tier", TIERS, "Prompt tokens whose KV came from an asynchicache tier"),
            "bytes": ("direction", DIRECTIONS, "Bytes copied between L2 and vLLM's KV blocks"),
            "events": ("event", EVENTS, "asynchicache connector events"),
            "refused": ("reason", REFUSALS, "Requests whose pages are not cached, by reason"),
        }
        self._bound: dict[tuple[int, str], Any] = {}
        hits = self._counter_cls(
            name="vllm:asynchicache_hits_total",
            documentation="Hits loaded from asynchicache, by their slowest tier and size",
            labelnames=[*labelnames, "tier", "size"],
        )
        sizes = [name for _, name in HIT_SIZES] + ["more"]
        for engine, labelvalues in per_engine_labelvalues.items():
            for tier in TIERS:
                for size in sizes:
                    key = f"hits_{tier}_{size}"
                    self._bound[(engine, key)] = hits.labels(*labelvalues, tier, size)
        for metric, (label, values, doc) in made.items():
            counter = self._counter_cls(
                name=f"vllm:asynchicache_{metric}",
                documentation=doc,
                labelnames=[*labelnames, label],
            )
            for engine, labelvalues in per_engine_labelvalues.items():
                for value in values:
                    key = f"{metric}_{value}" if metric != "events" else value
                    self._bound[(engine, key)] = counter.labels(*labelvalues, value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            bound = self._bound.get((engine_idx, name))
            if bound is not None and value:
                bound.inc(value)
