"""Workload generators: deterministic, shaped as documented, real text."""

from __future__ import annotations

import random
import statistics

import pytest

from asynchicache.bench.workloads import text
from asynchicache.bench.workloads.prompts import chat_ids
from asynchicache.bench.workloads.workloads import (
    LongdocParams,
    MultiturnParams,
    make_workload,
    override,
    poisson_arrivals,
)
from asynchicache.model.tokenizer import Tokenizer


@pytest.mark.parametrize("name", ["multiturn", "longdoc", "sysprompt"])
def test_same_seed_same_workload_other_seed_other_text(name: str) -> None:
    a = make_workload(name, seed=3, scale=0.1)
    b = make_workload(name, seed=3, scale=0.1)
    c = make_workload(name, seed=4, scale=0.1)
    assert a == b
    assert a.sessions != c.sessions
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in c.requests]


def test_multiturn_shape_round_robin_and_history() -> None:
    w = make_workload("multiturn", seed=1, scale=0.2, assignments=["users=3", "rounds=4"])
    assert len(w.sessions) == 3 and len(w.requests) == 12
    # Round-robin: every user speaks once per round, rounds in order.
    assert [(r.session, r.turn) for r in w.requests[:6]] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]  # fmt: skip
    assert len({s.system for s in w.sessions}) == 1  # one shared system prompt
    spec = w.requests[-1]  # user 2, round 3: sees its three earlier rounds
    msgs = w.messages(spec, ["a0", "a1", "a2"])
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == ["a0", "a1", "a2"]
    assert w.waits_for_previous(spec) and not w.waits_for_previous(w.requests[0])
    with pytest.raises(ValueError, match="earlier answers"):
        w.messages(spec, ["a0"])


def test_multiturn_prompt_of_next_round_extends_the_previous(tokenizer: Tokenizer) -> None:
    """The property the cache lives on: round r+1's prompt starts with round r's."""
    w = make_workload("multiturn", seed=0, scale=0.2, assignments=["users=1", "rounds=3"])
    p0 = chat_ids(tokenizer, w.messages(w.requests[0], []))
    p1 = chat_ids(tokenizer, w.messages(w.requests[1], ["The old bridge was rebuilt."]))
    assert len(p1) > len(p0) and p1[: len(p0)] == p0


def test_longdoc_lengths_order_and_tokens(tokenizer: Tokenizer) -> None:
    w = make_workload("longdoc", seed=2, assignments=[
        "docs=4", "min_doc_tokens=200", "max_doc_tokens=800", "questions=2"])  # fmt: skip
    assert len(w.sessions) == 4 and len(w.requests) == 8
    # Every document once before any is asked a second question.
    assert [r.session for r in w.requests] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [r.turn for r in w.requests] == [0, 0, 0, 0, 1, 1, 1, 1]
    lengths = sorted(len(tokenizer.encode(s.context)) for s in w.sessions)
    planned = [200, 400, 600, 800]
    for got, want in zip(lengths, planned, strict=True):
        assert abs(got - want) < 0.15 * want, (lengths, planned)
    # The same document before both questions, and questions that differ.
    s = w.sessions[0]
    assert s.user_text(0).startswith(s.context) and s.user_text(1).startswith(s.context)
    assert s.user_text(0) != s.user_text(1)
    assert not w.waits_for_previous(w.requests[4])


def test_sysprompt_few_long_prompts_many_short_questions(tokenizer: Tokenizer) -> None:
    w = make_workload(
        "sysprompt",
        seed=5,
        scale=0.2,
        assignments=["prompts=3", "requests=30", "question_tokens=20"],
    )
    assert len(w.requests) == 30 and len(w.sessions) == 3
    assert sum(len(s.questions) for s in w.sessions) == 30
    assert len({s.system for s in w.sessions}) == 3
    system = len(tokenizer.encode(w.sessions[0].system))
    question = len(tokenizer.encode(w.sessions[0].questions[0]))
    assert system > 5 * question
    # Every (session, turn) exactly once.
    assert len({(r.session, r.turn) for r in w.requests}) == 30


def test_scale_shrinks_lengths_not_counts() -> None:
    full = make_workload("longdoc", seed=0, assignments=["docs=2", "questions=1"])
    small = make_workload("longdoc", seed=0, scale=0.1, assignments=["docs=2", "questions=1"])
    assert len(small.requests) == len(full.requests)
    assert small.params["max_doc_tokens"] == 800 and full.params["max_doc_tokens"] == 8000
    assert len(small.sessions[0].context) < 0.2 * len(full.sessions[0].context)


def test_text_is_english_like_and_near_the_asked_length(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    body = text.text(rng, 1000)
    n = len(tokenizer.encode(body))
    assert 850 < n < 1150
    words = body.split()
    assert len(set(words)) > 50 and body.count(".") > 20
    assert "the" in words


def test_poisson_arrivals_rate_and_monotonic() -> None:
    times = poisson_arrivals(random.Random(9), rate=4.0, n=4000)
    gaps = [b - a for a, b in zip((0.0, *times), times, strict=False)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.06)
    # Exponential gaps: standard deviation close to the mean.
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)


def test_rate_changes_times_not_text() -> None:
    a = make_workload("multiturn", seed=0, scale=0.1, assignments=["rate=1"])
    b = make_workload("multiturn", seed=0, scale=0.1, assignments=["rate=10"])
    assert a.sessions == b.sessions
    assert b.requests[-1].arrival_s < a.requests[-1].arrival_s


def test_override_converts_and_rejects() -> None:
    p = override(MultiturnParams(), ["users=3", "rate=0.5", "max-tokens=7"])
    assert (p.users, p.rate, p.max_tokens) == (3, 0.5, 7)
    with pytest.raises(ValueError, match="users"):
        override(LongdocParams(), ["users=3"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        override(MultiturnParams(), ["users"])
    with pytest.raises(ValueError, match="positive"):
        make_workload("multiturn", assignments=["rounds=0"])
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")
