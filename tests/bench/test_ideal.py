"""The ideal hit rate: an upper bound from an unbounded page-level replay, on hand-made
sequences and against a real engine."""

from __future__ import annotations

import pytest

from asynchicache.bench.reports.run_results import RequestResult
from asynchicache.bench.workloads.ideal import replay
from asynchicache.bench.workloads.prompts import chat_ids, ideal_of_run, sent_messages
from asynchicache.bench.workloads.workloads import make_workload
from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.model.loader import LoadedModel
from asynchicache.model.tokenizer import Tokenizer
from asynchicache.settings.config import CacheConfig, EngineConfig

P = 4
A = list(range(1, 11))  # pages [1..4] [5..8], 2 tokens left over
B = [*range(1, 9), 20, 21, 22]  # A's two pages, then a partial page
C = list(range(1, 9))  # exactly A's two pages: all but the last token may hit
D = [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8, 1]  # [5..8] again, but after another page
E = [5, 6, 7, 8, 1, 2, 3, 4, 0]  # A's pages in the other order


def test_hand_made_sequence() -> None:
    r = replay([A, B, C, D, E], P)
    # A: 0 (cold); B: 8 (both pages); C: 7 (both pages, but its last token is computed);
    # D: 4 (the [5..8] page follows a different prefix: a different page);
    # E: 0 (order matters: a page is named by everything before it).
    assert r.hit_tokens == 0 + 8 + 7 + 4 + 0
    assert r.prompt_tokens == 10 + 11 + 8 + 13 + 9
    assert r.hit_rate == pytest.approx(19 / 51)
    # Distinct pages: A's 2, D's 2 new, E's 2 new.
    assert r.distinct_pages == 6 and r.working_set_tokens == 24


def test_short_prompts_and_repeats() -> None:
    assert replay([[1, 2, 3], [1, 2, 4]], P).hit_tokens == 0  # no full page, nothing cached
    five = [1, 2, 3, 4, 5]
    assert replay([five, [*five, 6]], P).hit_tokens == 4  # its one full page
    four = [1, 2, 3, 4]
    assert replay([four, [*four, 9, 9, 9, 9]], P).hit_tokens == 4  # its page
    assert replay([[*four, 9, 9, 9, 9], four], P).hit_tokens == 3  # less the last token
    # A prompt sent before whole hits every token (its last logits are kept).
    assert replay([[1, 2, 3]] * 3, P).hit_tokens == 6
    assert replay([five, five], P).hit_tokens == 5 and replay([four, four], P).hit_tokens == 4
    assert replay([], P).hit_rate == 0.0
    with pytest.raises(ValueError):
        replay([A], 0)


def test_warm_prompts_count_as_cached_but_not_as_requests() -> None:
    r = replay([B], P, warm=[A])
    assert (r.hit_tokens, r.prompt_tokens, r.distinct_pages) == (8, 11, 2)


def common_tokens(a: list[int], b: list[int]) -> int:
    """Tokens of `b` in leading full pages equal to `a`'s, at most len(b) - 1."""
    limit = min(len(a) // 16, len(b) // 16)
    n = 0
    while n < limit and a[n * 16 : (n + 1) * 16] == b[n * 16 : (n + 1) * 16]:
        n += 1
    return min(16 * n, len(b) - 1)


def continued_tokens(a: list[int], b: list[int], decoded: int) -> int:
    """Tokens of `b` that `a` and its `decoded` generated tokens may hold, when b extends a."""
    assert b[: len(a)] == a
    return min(len(b) - 1, 16 * min(len(b) // 16, (len(a) + decoded - 1) // 16))


def test_ideal_of_a_multiturn_run_counts_shared_history(tokenizer: Tokenizer) -> None:
    """Round 2 of each user hits round 1's whole prompt and answer; all users share the
    system prompt."""
    w = make_workload("multiturn", seed=0, scale=0.5, assignments=["users=2", "rounds=2"])
    results = [
        RequestResult(
            i,
            s.session,
            s.turn,
            s.arrival_s,
            float(i),
            ttft_s=0.1,
            answer=f"answer {s.session}-{s.turn} about the quiet harbour",
        )
        for i, s in enumerate(w.requests)
    ]
    ideal = ideal_of_run(w, results, None, 16, tokenizer)
    ids = [chat_ids(tokenizer, m) for m in sent_messages(w, results)]
    # Order: user 0, user 1, user 0 again, user 1 again. User 1's first prompt
    # shares the system prompt's full pages with user 0's; each second round
    # continues its own user's first prompt, whose answer (w.max_tokens decoded
    # tokens) may be cached too.
    expected = (
        common_tokens(ids[0], ids[1])
        + continued_tokens(ids[0], ids[2], w.max_tokens)
        + continued_tokens(ids[1], ids[3], w.max_tokens)
    )
    assert expected > common_tokens(ids[0], ids[2]) + common_tokens(ids[1], ids[3])
    assert ideal["hit_tokens"] == expected
    assert ideal["prompt_tokens"] == sum(len(t) for t in ids)
    assert 0.3 < ideal["hit_rate"] < 1


def test_generated_tokens_extend_what_may_hit() -> None:
    """A request that decodes 7 tokens caches its prompt and the first 6 of them."""
    first = list(range(1, 11))  # 2 full pages + [9, 10]
    answer = [30, 31, 32, 33, 34, 35]  # fed back: tokens 10..15, so page [9..32] is full
    follow = [*first, *answer, 40, 41, 42, 43, 44]  # the next turn repeats the answer
    r = replay([first, follow], P, decode_tokens=7)
    # (10 + 6) // 4 = 4 pages of `follow` may be cached: [1..4] [5..8] [9 10 30 31] [32..35].
    assert r.hit_tokens == 16
    # Without decoding only the prompt's 2 full pages; a 1-token decode feeds nothing back.
    assert replay([first, follow], P).hit_tokens == 8
    assert replay([first, follow], P, decode_tokens=1).hit_tokens == 8
    # The prompt's partial page must match: after [9, 11] the cached tokens are others.
    other = [*range(1, 9), 9, 11, *answer, 40]
    assert replay([first, other], P, decode_tokens=7).hit_tokens == 8
    # Generated tokens are assumed to be whatever a later prompt needs, but never
    # more of them than were decoded, and never the prompt's last token (here the
    # prompt's 3 pages may all be cached: all but its last token hit).
    assert replay([first, [*first, 50, 51]], P, decode_tokens=100).hit_tokens == 11
    assert replay([first, [*first, *range(50, 61)]], P, decode_tokens=100).hit_tokens == 20
    assert replay([first, [*first, *range(50, 61)]], P, decode_tokens=3).hit_tokens == 12
    with pytest.raises(ValueError):
        replay([A], P, decode_tokens=-1)


def test_the_ideal_bounds_a_real_engine_and_is_reached_when_answers_repeat(
    smollm: LoadedModel, tokenizer: Tokenizer
) -> None:
    """A multi-turn sequence whose cached tokens are known: the engine's equal the ideal.

    Each second turn repeats its first turn's prompt and generated tokens, so
    the engine hits every full page of them; a third request shares only the
    system prompt. The ideal must be >= what the engine cached, and here ==.
    """
    system = {"role": "system", "content": "You answer in short, plain sentences. " * 4}

    def ids(question: str) -> list[int]:
        messages = [system, {"role": "user", "content": question}]
        return chat_ids(tokenizer, messages)

    questions = ("Where do herons nest?", "Why is the sea salty?")
    # Just enough decoded tokens that the first answer fills the prompt's partial page
    # (the prompt and all but the last decoded token are cached): fewer decode steps.
    sampling = SamplingParams(
        max_tokens=17 - len(ids(questions[0])) % 16, temperature=0.0, ignore_eos=True
    )
    engine = Engine(
        EngineConfig(), CacheConfig(disk_cache_dir=None, host_cache_gb=0), loaded=smollm
    )
    try:
        sent, cached = [], []
        for question in questions:
            prompt = ids(question)
            first = engine.generate([prompt], sampling)[0]
            follow = [*prompt, *first.token_ids, *tokenizer.encode(" And then?")]
            second = engine.generate([follow], sampling)[0]
            sent += [prompt, follow]
            cached += [first.cached.total, second.cached.total]
        engine.cache.check_integrity()
    finally:
        engine.close()
    ideal = replay(sent, 16, decode_tokens=sampling.max_tokens)
    decoded = sampling.max_tokens - 1  # cached of the first answer: all but the last
    assert cached[1] == 16 * ((len(sent[0]) + decoded) // 16) > 16 * (len(sent[0]) // 16)
    assert cached[2] > 0  # the shared system prompt
    assert ideal.hit_tokens == sum(cached)


@pytest.mark.parametrize("kept_logits", [True, False])
def test_a_prompt_cached_whole_hits_every_token_or_all_but_its_last(
    smollm: LoadedModel, tokenizer: Tokenizer, kept_logits: bool
) -> None:
    """A page-aligned prompt sent again: with its last logits kept the engine computes no
    prompt token, without them only the last; the ideal counts every token, so it bounds
    the engine both ways (and equals it with the logits kept)."""
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    config = EngineConfig(prompt_logits_mib=64 if kept_logits else 0)
    engine = Engine(config, CacheConfig(disk_cache_dir=None, host_cache_gb=0), loaded=smollm)
    try:
        prompt = tokenizer.encode("The harbour lights came on one by one. " * 12)
        prompt = prompt[: len(prompt) // 16 * 16]
        cached = [engine.generate([prompt], sampling)[0].cached.total for _ in range(2)]
    finally:
        engine.close()
    assert cached == [0, len(prompt) if kept_logits else len(prompt) - 1]
    ideal = replay([prompt, prompt], 16, decode_tokens=2).hit_tokens
    assert ideal == len(prompt) >= sum(cached)
