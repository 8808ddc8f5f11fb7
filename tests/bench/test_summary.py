"""Percentile and summary math, and the results file round trip."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from asynchicache.bench.reports.run_results import RequestResult, read_results, write_results
from asynchicache.bench.reports.summary import Distribution, percentile, summarize


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_percentile_by_hand_and_edges() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # between 2 and 3
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    d = Distribution.of([1.0, 2.0, 3.0, 4.0])
    assert (d.n, d.mean, d.p50) == (4, 2.5, 2.5)
    assert math.isnan(Distribution.of([]).mean)


def _result(i: int, ttft: float, prompt: int, tiers: dict[str, int], **kw: object) -> RequestResult:
    return RequestResult(
        index=i,
        session=i,
        turn=0,
        scheduled_s=0.0,
        sent_s=float(i),
        ttft_s=ttft,
        e2e_s=ttft + 1.0,
        itl_s=(0.1, 0.3),
        prompt_tokens=prompt,
        completion_tokens=3,
        cached_tokens=sum(tiers.values()),
        cached_by_tier={"device": 0, "host": 0, "disk": 0, "remote": 0, **tiers},
        **kw,
    )


def test_summarize_totals_rates_and_tiers() -> None:
    results = [
        _result(0, 1.0, 100, {}),
        _result(1, 2.0, 100, {"device": 32, "host": 16}),
        _result(2, 6.0, 200, {"disk": 160}),
        RequestResult(3, 3, 0, 0.0, 3.0, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration_s=10.0)
    assert (s.requests, s.errors) == (4, 1)
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (400, 9, 208)
    assert s.hit_rate == pytest.approx(208 / 400)
    assert s.hit_rate_by_tier == pytest.approx(
        {"device": 32 / 400, "host": 16 / 400, "disk": 160 / 400, "remote": 0.0}
    )
    assert s.requests_per_s == pytest.approx(0.3)  # errors do not count as served
    assert s.output_tokens_per_s == pytest.approx(0.9)
    assert s.total_tokens_per_s == pytest.approx(40.9)
    assert s.ttft.mean == pytest.approx(3.0) and s.ttft.p50 == 2.0
    assert s.itl.n == 6 and s.itl.mean == pytest.approx(0.2)
    assert s.e2e.mean == pytest.approx(4.0)
    assert set(s.to_dict()) >= {"ttft", "itl", "e2e", "hit_rate", "hit_rate_by_tier"}


def test_summary_of_nothing_is_defined() -> None:
    s = summarize([], duration_s=0.0)
    assert s.requests == 0 and s.hit_rate == 0.0 and s.requests_per_s == 0.0


def test_results_round_trip(tmp_path: Path) -> None:
    rs = [
        _result(0, 0.5, 10, {"remote": 8}, answer='hé\n"quoted"'),
        RequestResult(1, 1, 2, 0.3, 0.4, error="x"),
    ]
    write_results(tmp_path / "r" / "results.jsonl", rs)
    back = read_results(tmp_path / "r" / "results.jsonl")
    assert back == rs
    assert back[0].ok and not back[1].ok
