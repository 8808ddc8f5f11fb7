"""What one scheduler step puts in a batch (tiny cache, no model)."""

from __future__ import annotations

from scheduler_rig import PAGE, RigMaker, assert_no_locks, tokens_for

from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Request
from asynchicache.settings.config import EngineConfig


def test_a_step_takes_the_prompts_it_finishes_and_one_chunk_of_another(
    make_rig: RigMaker,
) -> None:
    """Shortest remaining first; every prompt that completes, then one partial chunk, all of
    it at most max_prefill_tokens (engine/scheduling/prefill_policy.py)."""
    config = EngineConfig(
        min_load_tokens=0, chunked_prefill_size=3 * PAGE, max_prefill_tokens=8 * PAGE
    )
    rig = make_rig(device_pages=64, engine=config)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    pages = {"long-old": 5, "short": 1, "long-new": 5, "short-new": 2}
    for i, (rid, n) in enumerate(pages.items()):  # added in this order: arrival order
        first = 10 * i
        rig.scheduler.add(Request(rid, tokens_for(*range(first, first + n)), one))
    batch = rig.scheduler.schedule()
    taken = [(s.request.rid, s.num_new) for s in batch.seqs]
    # The two short prompts whole, then one chunk of the older long one; the newer long
    # prompt waits (a second partial chunk would make every first token of the step wait).
    assert taken == [("short", PAGE), ("short-new", 2 * PAGE), ("long-old", 3 * PAGE)]
    rig.scheduler.after_forward(batch)
    second = [(s.request.rid, s.num_new) for s in rig.scheduler.schedule().seqs]
    # (the short ones decode, one token each, ahead of the prompts)
    assert second[2:] == [("long-old", 2 * PAGE), ("long-new", 3 * PAGE)]  # the older first


def test_two_misses_of_one_prefix_compute_it_once(make_rig: RigMaker) -> None:
    """Two prompts on one uncached prefix, arriving together: the second takes what the
    first computed instead of computing it again (each chunk's full pages are shared as
    soon as they are computed, and a prompt that has computed nothing of its own yet
    matches again before its first chunk)."""
    config = EngineConfig(
        min_load_tokens=0, chunked_prefill_size=3 * PAGE, max_prefill_tokens=8 * PAGE
    )
    rig = make_rig(device_pages=64, engine=config)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prefix = tokens_for(*range(10, 16))  # 6 pages: two chunks of the first prompt
    first = Request("first", prefix + tokens_for(90), one)
    second = Request("second", prefix + tokens_for(91), one)
    rig.scheduler.add(first)
    rig.scheduler.add(second)
    computed = {"first": 0, "second": 0}
    while rig.scheduler.has_work:
        batch = rig.scheduler.schedule()
        for s in batch.seqs:
            if s.request.is_prefill:
                computed[s.request.rid] += s.num_new
        for req in rig.scheduler.after_forward(batch):
            rig.scheduler.finish(req, "length")
        rig.scheduler.drain_finished()
    assert computed == {"first": 7 * PAGE, "second": PAGE}
    assert second.cached.device == 6 * PAGE  # its usage reports the prefix as cached
    assert rig.scheduler.joined_tokens == 6 * PAGE
    # Counted once as L1 hits, however many steps the second prompt looked again.
    assert rig.cache.stats().counters.device_hit_tokens == 6 * PAGE
    rig.cache.drain()  # write-through copies of the shared chunks hold their pages till done
    assert_no_locks(rig.cache)


def test_long_misses_alone_take_the_step_budget_and_a_short_prompt_brings_chunks_back(
    make_rig: RigMaker,
) -> None:
    """With only long misses in hand a step computes up to --max-prefill-tokens of one
    (a longer step is a faster prefill); once a short prompt (a hit's tail) is in hand,
    prompts go in --chunked-prefill-size chunks again so its first token waits less."""
    config = EngineConfig(
        min_load_tokens=0, chunked_prefill_size=3 * PAGE, max_prefill_tokens=8 * PAGE
    )
    rig = make_rig(device_pages=64, engine=config)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rig.scheduler.add(Request("miss", tokens_for(*range(20)), one))
    batch = rig.scheduler.schedule()
    assert [(s.request.rid, s.num_new) for s in batch.seqs] == [("miss", 8 * PAGE)]
    rig.scheduler.after_forward(batch)
    rig.scheduler.add(Request("short", tokens_for(50), one))
    taken = [(s.request.rid, s.num_new) for s in rig.scheduler.schedule().seqs]
    assert taken == [("short", PAGE), ("miss", 3 * PAGE)]
