"""Percentiles, throughput and hit rates of one run's request results."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from asynchicache.bench.reports.run_results import RequestResult
from asynchicache.common.tiers import TIERS


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between order statistics.

    Same definition as numpy's default ("linear"): position q/100 * (n - 1)
    in the sorted values. NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        mean = sum(values) / len(values) if values else math.nan
        return cls(len(values), mean, *(percentile(values, q) for q in (50, 90, 99)))


@dataclass(frozen=True)
class RunSummary:
    """One run of a workload against one server."""

    requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt + completion tokens served per second
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    hit_rate_by_tier: dict[str, float]
    ttft: Distribution
    itl: Distribution
    e2e: Distribution

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def summarize(results: Sequence[RequestResult], duration_s: float) -> RunSummary:
    """Totals over successful requests; `duration_s` is the run's wall time."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    by_tier = {t: _rate(sum(r.cached_by_tier.get(t, 0) for r in ok), prompt) for t in TIERS}
    return RunSummary(
        requests=len(results),
        errors=len(results) - len(ok),
        duration_s=duration_s,
        requests_per_s=_rate(len(ok), duration_s),
        output_tokens_per_s=_rate(completion, duration_s),
        total_tokens_per_s=_rate(prompt + completion, duration_s),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        hit_rate=_rate(cached, prompt),
        hit_rate_by_tier=by_tier,
        ttft=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itl_s]),
        e2e=Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]),
    )
