"""Request groups in the engine: n samples over one prefill, shared pages released exactly
when the last member ends, per-member seeds, aborts that end every member."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asynchicache.engine.engine import Engine
from asynchicache.engine.group import member_seed
from asynchicache.engine.protocol import GenerateRequest, SamplingParams, TokenOutput
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig

TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that "
    "passed, the birds that rested on the rail, and the colour of the sea at dusk."
)


def _engine(model: LoadedModel, prefix: bool, **engine: object) -> Engine:
    cache = CacheConfig(
        disk_cache_dir=None, host_cache_gb=0, device_cache_tokens=2048, enable_prefix_cache=prefix
    )
    return Engine(EngineConfig(**engine), cache, loaded=model)  # type: ignore[arg-type]


def assert_released(engine: Engine) -> None:
    engine.cache.check_integrity()
    stats = engine.stats()
    assert stats["cache"]["device"]["in_use"] == 0, "a member kept private pages"
    assert stats["cache_lock_refs"] == 0, "a member kept a lock"


def run(engine: Engine, msg: GenerateRequest, abort_after: int | None = None) -> dict[int, dict]:
    """Step until every member finished; {index: {"tokens", "reason"}}."""
    assert engine.add_request(msg) is None
    got: dict[int, dict] = {i: {"tokens": [], "reason": None} for i in range(msg.n)}
    steps = 0
    while any(m["reason"] is None for m in got.values()):
        outs: list[TokenOutput] = engine.step()
        for out in outs:
            got[out.index]["tokens"] += out.token_ids
            if out.finished:
                got[out.index]["reason"] = out.finish_reason
        steps += 1
        if abort_after is not None and steps == abort_after:
            engine.abort(msg.rid)
        assert steps < 500
    return got


@pytest.fixture(params=[True, False], ids=["prefix-cache", "no-prefix-cache"])
def engine(request: pytest.FixtureRequest, smollm: LoadedModel) -> Iterator[Engine]:
    made = _engine(smollm, request.param)
    yield made
    made.close()


def test_member_seeds_fit_63_bits_and_differ() -> None:
    seeds = [member_seed(2**64 - 1, i) for i in range(8)]
    assert seeds[0] == 2**64 - 1 and len(set(seeds)) == 8
    assert all(0 <= s < 2**63 for s in seeds[1:])
    assert member_seed(None, 3) is None and member_seed(-5, 1) == member_seed(-5, 1)


@pytest.mark.parametrize("n", [2, 3])  # n=2: one page copy (caught by the HTTP fuzzing)
def test_greedy_members_equal_a_single_request_over_one_prefill(
    engine: Engine, smollm: LoadedModel, n: int
) -> None:
    prompt = tuple(smollm.tokenizer.encode(TEXT))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    single = run(engine, GenerateRequest("one", prompt, greedy))[0]["tokens"]
    assert_released(engine)
    engine.cache.clear()
    before = engine.computed_prompt_tokens
    group = run(engine, GenerateRequest("group", prompt, greedy, n=n))
    assert engine.computed_prompt_tokens - before == len(prompt)  # prefilled once
    assert [group[i]["tokens"] for i in range(n)] == [single] * n
    assert_released(engine)


def test_seeded_members_differ_and_repeat(engine: Engine, smollm: LoadedModel) -> None:
    prompt = tuple(smollm.tokenizer.encode(TEXT))
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=1234, ignore_eos=True)
    first = run(engine, GenerateRequest("a", prompt, params, n=4))
    again = run(engine, GenerateRequest("b", prompt, params, n=4))
    tokens = [tuple(first[i]["tokens"]) for i in range(4)]
    assert tokens == [tuple(again[i]["tokens"]) for i in range(4)]
    assert len(set(tokens)) == 4
    alone = run(engine, GenerateRequest("c", prompt, params))[0]["tokens"]
    assert tuple(alone) == tokens[0]  # member 0 draws from the request's own seed
    assert_released(engine)


def test_abort_ends_every_member(engine: Engine, smollm: LoadedModel) -> None:
    prompt = tuple(smollm.tokenizer.encode(TEXT * 3))
    params = SamplingParams(max_tokens=50, temperature=0.5, ignore_eos=True)
    late = run(engine, GenerateRequest("late", prompt, params, n=3), abort_after=4)
    assert {m["reason"] for m in late.values()} == {"abort"}
    assert all(0 < len(m["tokens"]) < 50 for m in late.values())
    assert_released(engine)


def test_waiting_followers_end_with_an_aborted_leader(smollm: LoadedModel) -> None:
    # several steps of prefill (16 tokens a step, also with the prompt alone in hand)
    engine = _engine(smollm, True, chunked_prefill_size=16, max_prefill_tokens=16)
    try:
        prompt = tuple(smollm.tokenizer.encode(TEXT))
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        got = run(engine, GenerateRequest("w", prompt, params, n=3), abort_after=1)
        assert [got[i] for i in range(3)] == [{"tokens": [], "reason": "abort"}] * 3
        assert_released(engine)
    finally:
        engine.close()


def test_members_survive_preemption(smollm: LoadedModel) -> None:
    """A device cache too small for all members: some are preempted and recompute, the
    greedy answers stay those of a lone request, and every page comes back."""
    cache = CacheConfig(disk_cache_dir=None, host_cache_gb=0, device_cache_tokens=160, page_size=16)
    engine = Engine(EngineConfig(), cache, loaded=smollm)
    try:
        prompt = tuple(smollm.tokenizer.encode(TEXT))
        greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        single = run(engine, GenerateRequest("one", prompt, greedy))[0]["tokens"]
        group = run(engine, GenerateRequest("four", prompt, greedy, n=4))
        assert [group[i]["tokens"] for i in range(4)] == [single] * 4
        assert engine.scheduler.preemptions > 0
        assert_released(engine)
    finally:
        engine.close()
