"""Bounded step time (`--max-step-ms`, engine/scheduling/prefill_policy.py's `StepBudget`): a step's
tokens follow the measured pace, hits take their first token in the next step, a miss
fills what is left and is never starved."""

from __future__ import annotations

import pytest
from scheduler_rig import PAGE, Rig, RigMaker, assert_no_locks, cached_prefix, step, tokens_for

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Request
from asynchicache.engine.scheduling.cost import CostModel, Mean, Rate, StepFit
from asynchicache.engine.scheduling.prefill_policy import (
    MIN_STEP_TOKENS,
    OVERHEAD_SHARES,
    STARVE_FLOOR_TOKENS,
    StepBudget,
)
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig

ONE = SamplingParams(max_tokens=1, temperature=0.0)
TWO = SamplingParams(max_tokens=2, temperature=0.0)
STEP_MS = 100.0
PACE = 1000.0  # tokens/s: 100 tokens fit a step of STEP_MS


def _rig(make_rig: RigMaker, max_prefill_tokens: int = 2048) -> Rig:
    config = EngineConfig(
        min_load_tokens=0,
        chunked_prefill_size=512,
        max_prefill_tokens=max_prefill_tokens,
        max_step_ms=STEP_MS,
    )
    rig = make_rig(device_pages=400, engine=config)
    rig.scheduler.cost.prefill_tok_s = Rate(PACE, weight=0.0)  # a fixed pace: no model here
    return rig


def test_the_budget_follows_the_pace_within_its_bounds() -> None:
    budget = StepBudget(max_step_s=0.2, cap=2048)
    assert budget.prompt_tokens(1000.0, decodes=0) == 200
    assert budget.prompt_tokens(1000.0, decodes=30) == 170  # the decodes ride in the step
    assert budget.prompt_tokens(100.0, decodes=0) == MIN_STEP_TOKENS  # a slow pace: the floor
    assert budget.prompt_tokens(1e6, decodes=0) == 2048  # a fast one: --max-prefill-tokens
    assert StepBudget(max_step_s=0.0, cap=2048).prompt_tokens(1.0, decodes=9) == 2048  # off
    # A fixed cost of 35 ms a step (quiet): the target rules; of 100 ms (busy cores): the
    # step grows until that cost is a quarter of it.
    assert budget.prompt_tokens(1000.0, decodes=0, fixed_s=0.035) == 200
    assert budget.prompt_tokens(1000.0, decodes=0, fixed_s=0.1) == OVERHEAD_SHARES * 100
    # The oldest prompt, left out: the floor, never past the cap, none without a bound.
    assert budget.floor_tokens(500, spent=150) == STARVE_FLOOR_TOKENS
    assert budget.floor_tokens(10, spent=150) == 10
    assert StepBudget(0.2, cap=40).floor_tokens(500, spent=30) == 10
    assert StepBudget(0.2, cap=40).floor_tokens(500, spent=40) == 0
    assert StepBudget(0.0, cap=2048).floor_tokens(500, spent=150) == 0


def test_a_steps_fixed_cost_is_learnt_from_its_first_measure_on() -> None:
    mean = Mean()
    mean.observe(0.0)  # nothing measured
    assert mean.value == 0.0
    mean.observe(0.04)
    assert mean.value == 0.04  # the first measure, not a fifth of it
    mean.observe(0.14)
    assert mean.value == pytest.approx(0.06)


def test_a_prompt_steps_fixed_cost_is_fitted_from_steps_of_different_sizes() -> None:
    fit = StepFit()
    for n in (64, 128, 256, 64, 128, 256, 64):  # 1 s fixed, 4 ms a token (busy cores)
        fit.observe(n, 1.0 + 0.004 * n)
    assert fit.fixed_s == 0.0  # too few steps to tell
    fit.observe(300, 1.0 + 0.004 * 300)
    assert fit.fixed_s == pytest.approx(1.0)
    same = StepFit()
    for _ in range(10):
        same.observe(100, 0.5)
    assert same.fixed_s == 0.0  # one size: no line through them
    noisy = StepFit()
    for n, sec in [(64, 0.05), (300, 0.02)] * 5:  # a line falling with size: clamped
        noisy.observe(n, sec)
    assert 0.0 <= noisy.fixed_s <= 0.02
    cost = CostModel.initial(page_bytes=1024, page_size=16, min_load_tokens=0)
    cost.small_step_s.observe(0.035)
    assert cost.step_fixed_s == 0.035  # the larger view: the prompts' fit knows nothing yet
    for n in (64, 128, 256, 300) * 2:
        cost.prompt_steps.observe(n, 1.0 + 0.004 * n)
    assert cost.step_fixed_s == pytest.approx(1.0)


def test_every_step_of_a_long_miss_beside_decodes_stays_within_the_time_budget(
    make_rig: RigMaker,
) -> None:
    rig = _rig(make_rig)
    decoding = SamplingParams(max_tokens=30, temperature=0.0)
    for i in range(3):
        rig.scheduler.add(Request(f"short{i}", tokens_for(100 + i), decoding))
    miss = Request("miss", tokens_for(*range(100)), ONE)  # 400 tokens
    rig.scheduler.add(miss)
    fits = int(STEP_MS / 1000 * PACE)
    steps_to_miss = 0
    while rig.scheduler.has_work:
        batch = step(rig)
        steps_to_miss += not miss.output
        assert batch.num_tokens <= fits, [(s.request.rid, s.num_new) for s in batch.seqs]
    assert miss.output == [1]
    # 12 + 400 prompt tokens at ~97 a step (the decodes take the rest): no step wasted.
    assert steps_to_miss <= 4
    rig.cache.drain()
    assert_no_locks(rig.cache)


def test_a_hit_behind_a_long_miss_gets_its_first_token_in_the_next_step(
    make_rig: RigMaker,
) -> None:
    rig = _rig(make_rig)
    prefix = tokens_for(*range(200, 210))
    cached_prefix(rig, prefix)
    miss = Request("miss", tokens_for(*range(100)), ONE)  # 400 tokens, nothing cached
    rig.scheduler.add(miss)
    first = step(rig)
    assert [(s.request.rid, s.num_new) for s in first.seqs] == [("miss", 100)]
    hit = Request("hit", prefix + tokens_for(300), ONE)  # arrives during that step
    rig.scheduler.add(hit)
    second = step(rig)
    taken = [(s.request.rid, s.num_new) for s in second.seqs]
    # Its uncached page first, then the miss fills what is left of the step.
    assert taken == [("hit", PAGE), ("miss", 100 - PAGE)]
    assert hit.output == [1] and hit.cached.device == len(prefix)
    assert miss.is_prefill and miss.num_computed == 200 - PAGE  # far from done
    while rig.scheduler.has_work:
        step(rig)
    rig.cache.drain()
    assert_no_locks(rig.cache)


def test_a_stream_of_hits_never_starves_a_miss(make_rig: RigMaker) -> None:
    rig = _rig(make_rig)
    prefix = tokens_for(*range(200, 210))
    cached_prefix(rig, prefix)
    miss = Request("miss", tokens_for(*range(100)), ONE)
    rig.scheduler.add(miss)
    step(rig)
    done = miss.num_computed
    for k in range(6):
        # Hits of 25 uncached pages each: together past the step's budget.
        for j in range(2):
            tail = tokens_for(*range(1000 + 100 * k + 30 * j, 1000 + 100 * k + 30 * j + 25))
            rig.scheduler.add(Request(f"hit{k}-{j}", prefix + tail, ONE))
        step(rig)
        assert miss.num_computed >= done + STARVE_FLOOR_TOKENS  # it moved on every step
        done = miss.num_computed
    while rig.scheduler.has_work:
        step(rig)
    rig.cache.drain()
    assert_no_locks(rig.cache)


@pytest.mark.parametrize("prompt_tokens", [300])
def test_time_bounded_chunks_give_the_tokens_and_logprobs_of_a_whole_prefill(
    tiny_llama: LoadedModel, prompt_tokens: int
) -> None:
    """The correctness side: chunks of MIN_STEP_TOKENS give what one whole step gives."""
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = [(7 * i) % 1000 + 1 for i in range(prompt_tokens)]

    def run(max_step_ms: float) -> tuple[tuple[int, ...], float, int]:
        engine = Engine(
            EngineConfig(max_step_ms=max_step_ms, prompt_logits_mib=0),
            CacheConfig(disk_cache_dir=None, host_cache_gb=0.0, device_cache_tokens=1024),
            loaded=tiny_llama,
        )
        engine.cost.prefill_tok_s = Rate(1.0, weight=0.0)  # the budget's floor every step
        try:
            out = engine.generate([prompt], sampling)[0]
            return out.token_ids, out.cumulative_logprob, engine.steps
        finally:
            engine.close()

    whole, chunked = run(0.0), run(1.0)
    assert whole[2] == 6  # one prompt step, five decodes
    assert chunked[2] == 5 + -(-prompt_tokens // MIN_STEP_TOKENS)  # five chunks
    assert chunked[0] == whole[0]
    assert chunked[1] == pytest.approx(whole[1], abs=1e-4)


def test_the_warm_up_measures_the_pace_that_sizes_the_first_steps(
    tiny_llama: LoadedModel,
) -> None:
    engine = Engine(
        EngineConfig(),
        CacheConfig(disk_cache_dir=None, host_cache_gb=0.0, device_cache_tokens=512),
        loaded=tiny_llama,
    )
    try:
        guess = engine.cost.prefill_tok_s.value
        engine.warm_up()  # its longest forward: 511 tokens (L1 holds 512)
        measured = engine.cost.prefill_tok_s.value
    finally:
        engine.close()
    assert measured != guess and measured > 0  # the start-up guess is gone at once
