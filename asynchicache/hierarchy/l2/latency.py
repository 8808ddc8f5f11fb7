"""Latency histograms of the cache's transfers, per direction and tier, for /metrics.

    load  host     L2 -> L1 (a load whose pages all were in L2)
    load  disk     L3 -> L2 (-> L1): a load or an arrival prefetch that read the disk
    load  remote   the same, with pages from L4
    store host     L1 -> L2 copies (write-through, write-back)
    store disk     L2 -> L3 stores (the cache service writes L4 behind them)

Counts per bucket, like a Prometheus histogram (the last bucket is +Inf); the engine
reports `snapshot()` in its stats and the HTTP process renders it (server/engine_metrics.py).
Only durations and tier names: nothing of a request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds in seconds: 0.5 ms (an L2 copy on a GPU) to a minute (a stuck store).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0
)  # fmt: skip


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += max(0.0, seconds)


@dataclass
class Latencies:
    """One histogram per (operation, tier), created on first use (scheduler thread only)."""

    histograms: dict[tuple[str, str], Histogram] = field(default_factory=dict)

    def observe(self, op: str, tier: str, seconds: float) -> None:
        self.histograms.setdefault((op, tier), Histogram()).observe(seconds)

    def snapshot(self) -> dict[str, dict[str, dict[str, object]]]:
        """{op: {tier: {"buckets": bounds, "counts": per bucket (+Inf last), "sum"}}}."""
        out: dict[str, dict[str, dict[str, object]]] = {}
        for (op, tier), h in sorted(self.histograms.items()):
            out.setdefault(op, {})[tier] = {
                "buckets": list(LATENCY_BUCKETS), "counts": list(h.counts), "sum": h.sum,
            }  # fmt: skip
        return out
