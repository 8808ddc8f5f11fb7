"""A request that fails inside an engine step fails alone (engine/isolation.py).

Issue 22: one request's sampling error ("probability tensor contains either inf,
nan or element < 0") ended the engine process, and every other client's stream
with it. Here a request carries a value no validation caught (a corrupted
`top_p`, set past the frozen dataclass) among greedy and seeded requests: it
ends with an error, the others give exactly the tokens they give without it. A
forward pass that raises because of one request's input ends that request alone
(issue 39: each sequence runs alone to find it, then the others run again); one
that raises for every request ends the step's requests, one that raises once
fails nobody; the engine serves the next ones as before, with every page and
lock released.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import closing

import pytest
from engine_fixtures import l1_only_engine

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import GenerateRequest, SamplingParams
from asynchicache.model.loader import LoadedModel
from asynchicache.model.runner import ForwardBatch

PROMPTS = {
    "greedy": "The capital of France is",
    "seeded": "Once upon a time, in a small village,",
    "bad": "The tallest mountain on Earth is",
    "group": "Water boils at a temperature of",
}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=4, temperature=0.8, seed=11, ignore_eos=True)


@pytest.fixture
def engine(smollm: LoadedModel) -> Iterator[Engine]:
    with closing(l1_only_engine(smollm, 2048)) as made:
        yield made


def _corrupt(engine: Engine, rid: str) -> None:
    """Give the queued request `rid` a value no validation caught: the sampler raises on
    it (set after queueing, past the frozen dataclass's checks)."""
    (req,) = [r for r in engine.scheduler.waiting if r.rid == rid]
    bad = copy.copy(req.sampling)
    object.__setattr__(bad, "top_p", "not a number")
    req.sampling = bad


def _requests(engine: Engine, with_bad: bool) -> list[GenerateRequest]:
    encode = engine.loaded.tokenizer.encode
    reqs = [
        GenerateRequest("greedy", tuple(encode(PROMPTS["greedy"])), GREEDY),
        GenerateRequest("seeded", tuple(encode(PROMPTS["seeded"])), SEEDED),
        GenerateRequest("group", tuple(encode(PROMPTS["group"])), SEEDED, n=2),
    ]
    if with_bad:
        reqs.insert(1, GenerateRequest("bad", tuple(encode(PROMPTS["bad"])), SEEDED))
    return reqs


def _run(
    engine: Engine, reqs: list[GenerateRequest], corrupt: bool = True
) -> dict[tuple[str, int], dict]:
    """Step until every member of every request finished: {(rid, index): outcome}."""
    got = {
        (r.rid, i): {"tokens": [], "reason": None, "error": None} for r in reqs for i in range(r.n)
    }
    for req in reqs:
        assert engine.add_request(req) is None
    if any(r.rid == "bad" for r in reqs) and corrupt:
        _corrupt(engine, "bad")
    steps = 0
    while any(o["reason"] is None for o in got.values()):
        for out in engine.step():
            entry = got[(out.rid, out.index)]
            entry["tokens"] += out.token_ids
            if out.finished:
                entry["reason"], entry["error"] = out.finish_reason, out.error
        steps += 1
        assert steps < 200, got
        engine.cache.check_integrity()
    return got


def _assert_released(engine: Engine) -> None:
    engine.cache.check_integrity()
    stats = engine.stats()
    assert stats["cache"]["device"]["in_use"] == 0
    assert stats["cache_lock_refs"] == 0
    assert not engine.has_work


def test_a_request_that_fails_to_sample_fails_alone(engine: Engine) -> None:
    alone = _run(engine, _requests(engine, with_bad=False))
    engine.cache.clear()
    together = _run(engine, _requests(engine, with_bad=True))
    bad = together.pop(("bad", 0))
    assert bad["reason"] == "error" and bad["tokens"] == []
    assert "sampling (ValueError)" in bad["error"] and PROMPTS["bad"] not in bad["error"]
    assert together == alone  # the others: the same tokens, seeded ones included
    assert engine.stats()["failed_requests"] == 1
    _assert_released(engine)


def test_a_forward_pass_that_always_fails_ends_its_step_and_the_engine_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _run(engine, _requests(engine, with_bad=False))
    engine.cache.clear()
    real_forward = engine.runner.forward
    calls = {"n": 0, "armed": True}

    def failing_forward(batch: object) -> object:
        calls["n"] += 1
        if calls["n"] >= 3 and calls["armed"]:  # mid-decode, every request, alone or not
            raise RuntimeError("a kernel failed")
        return real_forward(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    failed = _run(engine, _requests(engine, with_bad=False))
    assert {o["reason"] for o in failed.values()} == {"error"}
    assert all("RuntimeError" in o["error"] for o in failed.values())
    _assert_released(engine)
    calls["armed"] = False
    again = _run(engine, _requests(engine, with_bad=False))
    assert again[("greedy", 0)] == reference[("greedy", 0)]
    assert again == reference
    _assert_released(engine)


def test_a_forward_pass_that_fails_once_is_retried(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39, finding 14: a failure no request can be blamed for (it does not come back
    when each sequence runs alone) fails nobody: the forward runs again."""
    reference = _run(engine, _requests(engine, with_bad=False))
    engine.cache.clear()
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def flaky_forward(batch: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a kernel failed once")
        return real_forward(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.runner, "forward", flaky_forward)
    assert _run(engine, _requests(engine, with_bad=False)) == reference
    assert engine.stats()["failed_requests"] == 0
    _assert_released(engine)


def test_a_request_that_fails_the_forward_pass_fails_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39, finding 14: one request whose tokens make the forward raise (a kernel error
    tied to its input) ends with an error; the forward runs again without it, and the
    others of its step give exactly the tokens they give without it."""
    alone = _run(engine, _requests(engine, with_bad=False))
    engine.cache.clear()
    poison = list(engine.loaded.tokenizer.encode(PROMPTS["bad"]))
    real_forward = engine.runner.forward

    def forward(batch: ForwardBatch) -> object:
        if any(list(ids) == poison for ids in batch.token_ids):
            raise RuntimeError("a kernel failed on this input")
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "forward", forward)
    together = _run(engine, _requests(engine, with_bad=True), corrupt=False)
    bad = together.pop(("bad", 0))
    assert bad["reason"] == "error" and bad["tokens"] == []
    assert "RuntimeError" in bad["error"] and PROMPTS["bad"] not in bad["error"]
    assert together == alone
    assert engine.stats()["failed_requests"] == 1
    _assert_released(engine)
