"""`bench pressure --workload conversation`: multi-turn sessions of a chat's shape."""

from __future__ import annotations

import pytest

from asynchicache.bench.connector_hits import connector_counters
from asynchicache.bench.workloads.conversation_workload import (
    MIN_GAP,
    ConversationParams,
    build,
    reusable_page_fraction,
    warm_up_prompt,
)
from asynchicache.model.tokenizer import Tokenizer

SMALL = ConversationParams(sessions=120, mean_turns=2.0, max_turns=4, seed=3)


def test_sessions_share_only_the_system_page_and_come_back_after_the_others(
    tokenizer: Tokenizer,
) -> None:
    w = build(SMALL, tokenizer)
    assert build(SMALL, tokenizer) == w  # the same prompts for every arm
    system = w.requests[0].prompt[:16]
    assert all(r.prompt[:16] == system for r in w.requests)
    firsts = [r for r in w.requests if r.turn == 0]
    assert len(firsts) == 120 and len({r.prompt[16:32] for r in firsts}) == 120
    last: dict[int, tuple[int, tuple[int, ...]]] = {}  # session -> (index, prompt)
    gaps = []  # requests between two turns of a session
    for i, r in enumerate(w.requests):
        if r.turn:
            before, prompt = last[r.prefix]
            assert r.prompt[: len(prompt)] == prompt  # the whole history again
            grows = SMALL.reply_tokens + SMALL.user_tokens
            assert len(r.prompt) == len(prompt) + grows
            if i < len(w.requests) - 2 * MIN_GAP:  # the run's end: few sessions left
                gaps.append(i - before)
        last[r.prefix] = (i, r.prompt)
    # A session comes back after MIN_GAP requests while another one is ready, else
    # the one whose last turn is the oldest goes.
    assert min(gaps) >= MIN_GAP, gaps
    d = w.describe()
    assert (
        d["requests"]
        == len(w.requests)
        == sum(int(t) * n for t, n in d["turns"].items())
        == sum(n for n in d["turns"].values()) + sum(1 for r in w.requests if r.turn)
    )
    assert 0.1 < d["reusable_page_fraction"] < 0.9
    warm = warm_up_prompt(SMALL, tokenizer)
    assert warm[:16] != list(system)
    with pytest.raises(ValueError, match="mean-turns"):
        ConversationParams(mean_turns=9.0)


def test_reusable_pages_are_those_whose_whole_prefix_came_before() -> None:
    a = tuple(range(40))  # 2 full pages
    b = a[:20] + tuple(range(100, 120))  # page 0 shared, page 1 not (diverges at 20)
    assert reusable_page_fraction([a, b]) == 1 / 4
    assert reusable_page_fraction([a, a]) == 2 / 4
    assert reusable_page_fraction([]) == 0.0


def test_the_connectors_counters_are_read_from_metrics() -> None:
    metrics = {
        'vllm:asynchicache_hits_total{engine="0",model_name="m",tier="host",size="le16"}': 5.0,
        'vllm:asynchicache_hits_total{engine="0",model_name="m",tier="disk",size="le1024"}': 2.0,
        'vllm:asynchicache_hits_total{engine="1",model_name="m",tier="host",size="le16"}': 1.0,
        'vllm:asynchicache_hit_tokens_total{engine="0",model_name="m",tier="host"}': 96.0,
        'vllm:asynchicache_events_total{engine="0",model_name="m",event="lookups"}': 9.0,
        'vllm:asynchicache_events_total{engine="0",model_name="m",event="load_errors"}': 0.0,
        "vllm:prefix_cache_hits_total": 3.0,
    }
    assert connector_counters(metrics) == {
        "connector_hits": {"host": {"le16": 6.0}, "disk": {"le1024": 2.0}},
        "connector_hit_tokens": {"host": 96.0},
        "connector_events": {"lookups": 9.0},
    }
    assert connector_counters({"vllm:prefix_cache_hits_total": 3.0}) == {}
