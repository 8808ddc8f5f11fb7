"""The ideal hit rate: an unbounded page-level prefix replay, on hand-made sequences."""

from __future__ import annotations

import pytest

from asynchicache.bench.ideal import replay
from asynchicache.bench.prompts import chat_ids, ideal_of_run, sent_messages
from asynchicache.bench.results import RequestResult
from asynchicache.bench.workloads import make_workload
from asynchicache.engine.tokenizer import Tokenizer

P = 4
A = list(range(1, 11))  # pages [1..4] [5..8], 2 tokens left over
B = [*range(1, 9), 20, 21, 22]  # A's two pages, then a partial page
C = list(range(1, 9))  # exactly A's two pages: the last token must be computed
D = [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8, 1]  # [5..8] again, but after another page
E = [5, 6, 7, 8, 1, 2, 3, 4, 0]  # A's pages in the other order


def test_hand_made_sequence() -> None:
    r = replay([A, B, C, D, E], P)
    # A: 0 (cold); B: 8 (both pages); C: 4 (only (8-1)//4 = 1 page may hit);
    # D: 4 (the [5..8] page follows a different prefix: a different page);
    # E: 0 (order matters: a page is named by everything before it).
    assert r.hit_tokens == 0 + 8 + 4 + 4 + 0
    assert r.prompt_tokens == 10 + 11 + 8 + 13 + 9
    assert r.hit_rate == pytest.approx(16 / 51)
    # Distinct pages: A's 2, D's 2 new, E's 2 new.
    assert r.distinct_pages == 6 and r.working_set_tokens == 24


def test_short_prompts_and_repeats() -> None:
    assert replay([[1, 2, 3]] * 3, P).hit_tokens == 0  # no full page, nothing cached
    five = [1, 2, 3, 4, 5]
    assert replay([five, five], P).hit_tokens == 4  # (5-1)//4 = 1 page
    assert replay([], P).hit_rate == 0.0
    with pytest.raises(ValueError):
        replay([A], 0)


def test_warm_prompts_count_as_cached_but_not_as_requests() -> None:
    r = replay([B], P, warm=[A])
    assert (r.hit_tokens, r.prompt_tokens, r.distinct_pages) == (8, 11, 2)


def common_pages(a: list[int], b: list[int]) -> int:
    """Leading full pages of `b` equal to `a`'s, at most (len(b) - 1) // 16."""
    limit = min(len(a) // 16, (len(b) - 1) // 16)
    n = 0
    while n < limit and a[n * 16 : (n + 1) * 16] == b[n * 16 : (n + 1) * 16]:
        n += 1
    return n


def test_ideal_of_a_multiturn_run_counts_shared_history(tokenizer: Tokenizer) -> None:
    """Round 2 of each user hits round 1's whole prompt; all users share the system prompt."""
    w = make_workload("multiturn", seed=0, scale=0.5, assignments=["users=2", "rounds=2"])
    results = [
        RequestResult(i, s.session, s.turn, s.arrival_s, float(i), ttft_s=0.1,
                      answer=f"answer {s.session}-{s.turn} about the quiet harbour")
        for i, s in enumerate(w.requests)
    ]
    ideal = ideal_of_run(w, results, None, 16, tokenizer)
    ids = [chat_ids(tokenizer, m) for m in sent_messages(w, results)]
    # Order: user 0, user 1, user 0 again, user 1 again. User 1's first prompt
    # shares the system prompt's full pages with user 0's; each second round
    # shares its own user's first prompt.
    expected = 16 * (common_pages(ids[0], ids[1]) + common_pages(ids[0], ids[2])
                     + common_pages(ids[1], ids[3]))
    assert ideal["hit_tokens"] == expected
    assert ideal["prompt_tokens"] == sum(len(t) for t in ids)
    assert 0.3 < ideal["hit_rate"] < 1
