"""The engine's per-request trace (engine/trace.py): the phases of a real run add up."""

from __future__ import annotations

import pytest

from asynchicache.config import CacheConfig, EngineConfig
from asynchicache.engine.engine import Engine
from asynchicache.engine.loader import LoadedModel
from asynchicache.engine.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama: LoadedModel) -> Engine:
    made = Engine(
        EngineConfig(chunked_prefill_size=32, max_prefill_tokens=32),
        CacheConfig(disk_cache_dir=None, host_cache_gb=0.01, device_cache_tokens=512),
        loaded=tiny_llama,
    )
    yield made
    made.cache.check_integrity()
    made.close()


def test_a_chunked_prefill_shows_its_steps_and_a_queue_behind_it(engine: Engine) -> None:
    long, short = list(range(1, 97)), list(range(200, 220))
    engine.generate([long, short], GREEDY)
    traces = {t.prompt_tokens: t for t in engine.tracer.traces()}
    first, second = traces[96], traces[20]
    # 96 tokens in chunks of 32, at most 32 prompt tokens a step: 3 forwards for the first.
    assert first.steps == 3 and first.computed_tokens == 96
    # The second's prefill waits for a step with room: it waited, then ran.
    assert second.first_token is not None and second.first_token > first.first_token
    for t in (first, second):
        assert t.ttft_s is not None and t.ttft_s > 0
        assert t.step_s > 0 and t.max_step_s <= t.step_s and t.max_step_tokens > 0
        assert t.admitted is not None and t.queue_s >= 0
        # Every second of the way to the first token is in one phase or another.
        parts = t.queue_s + t.load_s + t.wait_s + t.step_s + t.overhead_s
        assert parts == pytest.approx(t.ttft_s, abs=1e-6)
    assert second.wait_s > 0  # not in the steps that carried the first's chunks
    summary = engine.stats()["request_traces"]
    assert summary["requests"] == 2
    assert summary["slowest"][0]["ttft_s"] == max(first.ttft_s, second.ttft_s)
    assert set(summary["ttft_s"]) == {"mean", "p50", "p90", "p99", "max"}


def test_an_l2_hit_shows_its_load(engine: Engine) -> None:
    prompt = list(range(1, 65))
    engine.generate([prompt], GREEDY)
    engine.cache.drain()
    engine.cache.evict(engine.cache.stats().device.total)  # the prompt is on L2 alone now
    engine.generate([prompt], GREEDY)
    hit = engine.tracer.traces()[-1]
    assert hit.cached.get("host") == 63  # its last token is computed again (copy-on-write)
    assert hit.load_s > 0 and hit.computed_tokens == 1
    assert hit.queue_s + hit.load_s + hit.wait_s + hit.step_s + hit.overhead_s == pytest.approx(
        hit.ttft_s, abs=1e-6
    )
