"""Requests enter during steps (engine/inbox.py): the socket is read while a step runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from loop_harness import LoopHarness

from asynchicache.engine.engine import Engine
from asynchicache.engine.inbox import Inbox
from asynchicache.engine.protocol import AbortRequest, SamplingParams, encode
from asynchicache.model.loader import LoadedModel
from asynchicache.model.runner import ForwardBatch
from asynchicache.settings.config import CacheConfig, EngineConfig

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
STEP_S = 0.6  # the held step: long against a message's way through ZeroMQ (~ms)


@pytest.fixture
def engine(tiny_llama: LoadedModel) -> Iterator[Engine]:
    made = Engine(
        EngineConfig(prompt_logits_mib=0),
        CacheConfig(disk_cache_dir=None, host_cache_gb=0.0, device_cache_tokens=512),
        loaded=tiny_llama,
    )
    yield made
    made.cache.check_integrity()
    made.close()


class HeldStep:
    """Holds the engine's first forward for `STEP_S`; records when it began and ended."""

    def __init__(self, engine: Engine) -> None:
        self.forward = engine.runner.forward
        self.began = threading.Event()
        self.ended: list[float] = []
        engine.runner.forward = self  # type: ignore[method-assign]

    def __call__(self, batch: ForwardBatch) -> object:
        if self.began.is_set():
            return self.forward(batch)
        self.began.set()
        time.sleep(STEP_S)
        out = self.forward(batch)
        self.ended.append(time.monotonic())
        return out


def test_a_request_sent_during_a_step_is_received_before_the_step_ends(engine: Engine) -> None:
    held = HeldStep(engine)
    harness = LoopHarness(engine)
    try:
        first = harness.send(list(range(1, 40)), GREEDY)
        assert held.began.wait(30)
        sent = time.monotonic()
        second = harness.send(list(range(100, 120)), GREEDY)
        harness.collect([first, second])
    finally:
        harness.stop()
    traces = {t.rid: t for t in engine.tracer.traces()}
    # Its trace starts when the inbox had it, inside the held step, not when the step ended.
    assert sent <= traces[second].arrived < held.ended[0]
    assert traces[second].queue_s > 0  # then it queued for the next step
    assert harness.loop.inbox.received == 2


def test_an_abort_sent_during_a_step_ends_a_request_queued_in_the_same_step(
    engine: Engine,
) -> None:
    """Order holds through the inbox: an abort right behind its request ends it."""
    held = HeldStep(engine)
    harness = LoopHarness(engine)
    try:
        first = harness.send(list(range(1, 40)), GREEDY)
        assert held.began.wait(30)
        second = harness.send(list(range(100, 120)), GREEDY)
        harness.send_sock.send(encode(AbortRequest(second)))
        done = harness.collect([first, second])
    finally:
        harness.stop()
    assert done[0].finish_reason == "length" and len(done[0].token_ids) == 2
    assert done[1].finish_reason == "abort" and done[1].token_ids == ()


def test_the_inbox_drops_a_malformed_message_and_takes_the_next() -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://inbox-test")
    push.connect("inproc://inbox-test")
    inbox = Inbox(pull, poll_ms=10)
    inbox.start()
    try:
        push.send(b"\x00 not a message")
        push.send(encode(AbortRequest("r1")))
        got = inbox.take(wait_s=5)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = inbox.take(wait_s=0.1)
        assert [r.msg for r in got] == [AbortRequest("r1")]
        assert inbox.dropped == 1 and inbox.received == 1 and inbox.failures == 0
        assert inbox.take() == []  # nothing more, and no wait
    finally:
        inbox.close()
        for sock in (pull, push):
            sock.close(linger=0)
        ctx.term()
