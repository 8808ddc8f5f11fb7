"""The connector loads a hit only when it pays, and never makes a request wait for a
lookup that cannot help it (issue 40), under vLLM's real scheduler (sched_harness.py).

A prompt's pages sit on disk only (a first instance computed them, then went). A
second instance, whose rates are a CPU's (FakeModel computes in no time, so the
test sets them: 1,000 prompt tokens/s, 0.2 s steps, the disk read slowed to
0.3 s), gets two requests: one whose whole possible hit is below the break-even
of waiting a step for a disk read is scheduled in the first step, as vLLM alone
schedules it (on main 9f7c8b6 it skipped that step waiting for its read), and
one above it waits for its read and is loaded, its K/V exact.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from sched_harness import PAGE, Engine, Truth, tiny_model_folder

from asynchicache.hierarchy.load_cost import Rate
from asynchicache.integrations.vllm.load_policy import DISK, HOST, LoadPolicy

pytestmark = pytest.mark.timeout(600)

SLOW_READ_S = 0.3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("policy-model"))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


def cpu_rates(policy: LoadPolicy) -> None:
    """Fixed rates of a CPU vLLM (weight 0: the fake steps do not move them)."""
    policy.cost.prefill_tok_s = Rate(1000.0, weight=0.0)
    policy.step_s = Rate(0.2, weight=0.0)
    for tier in (DISK, HOST):
        policy.cost.bandwidth[tier].weight = 0.0


def slow_reads(engine: Engine) -> None:
    """Every read into L2 reaches the service SLOW_READ_S late (a slow disk)."""
    link = engine.side.link
    load = link.load

    def late(job: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        threading.Timer(SLOW_READ_S, load, (job, hashes, slots)).start()

    link.load = late  # type: ignore[method-assign]


def scheduled(out: Any) -> dict[str, int]:
    """New requests of a step: id -> the tokens vLLM counted computed (external hits)."""
    return {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}


def test_a_hit_below_break_even_is_not_waited_for_and_one_above_is_loaded(
    model: Path, tmp_path: Path
) -> None:
    shared = tokens(1, 40 * PAGE + 1)
    first = Engine(model, tmp_path / "root")
    try:
        first.add("computes", Truth(shared, [7, 8]), max_tokens=2)
        first.run()
        first.settle()
    finally:
        first.shutdown()  # L2 and the service go: only the disk keeps the pages
    again = Engine(model, tmp_path / "root", extra={"load_policy": "cost"})
    try:
        policy = again.side.policy
        cpu_rates(policy)
        slow_reads(again)
        wait_even = policy.break_even_tokens(DISK, wait=True)
        assert wait_even is not None and 8 * PAGE <= wait_even <= 16 * PAGE  # 13 pages
        # small: 3 pages on disk, 5 pages in all (its whole possible hit is below);
        # large: 36 pages on disk, far above.
        small = Truth(shared[: 3 * PAGE] + tokens(2, 2 * PAGE + 5), [3, 4])
        large = Truth(shared[: 36 * PAGE] + tokens(3, PAGE + 5), [5, 6])
        assert len(small.prompt) - 1 < wait_even <= 36 * PAGE
        again.add("small", small, max_tokens=2)
        again.add("large", large, max_tokens=2)
        step1 = scheduled(again.step())
        assert step1 == {"small": 0}  # small went at once, recomputed; large waits
        assert again.stat("lookups_not_waited") >= 1
        for _ in range(200):
            out = again.step()
            if "large" in scheduled(out):
                break
        else:
            raise AssertionError("large never scheduled")
        assert scheduled(out)["large"] == 36 * PAGE  # loaded from disk
        blocks = again.scheduler.kv_cache_manager.get_block_ids("large")[0]
        assert again.model.wrong_positions(blocks, large, len(large.prompt)) == []
        again.run()
        # vLLM's own prefix cache holds the first block (small computed it): the
        # connector loaded the 34 pages after it, no more.
        assert again.hit_tokens() == 34 * PAGE, str(dict(again.stats))
        assert again.stat("hit_tokens_disk") == 34 * PAGE
    finally:
        again.shutdown()


def test_rates_are_measured_from_vllms_steps(model: Path, tmp_path: Path) -> None:
    """The L2 copy rate is timed at start; the step time and prefill rate move with the
    steps vLLM runs (here FakeModel's, far faster than a CPU's)."""
    engine = Engine(model, tmp_path / "root", extra={"load_policy": "cost"})
    try:
        policy = engine.side.policy
        assert policy.cost.bandwidth[HOST].value > 0
        start_prefill, start_step = policy.cost.prefill_tok_s.value, policy.step_s.value
        for i in range(4):
            engine.add(f"r{i}", Truth(tokens(10 + i, 6 * PAGE + 3), [1, 2]), max_tokens=2)
            engine.run()
        assert policy.cost.prefill_tok_s.value > start_prefill  # fake steps are fast
        assert policy.step_s.value < start_step
        # With a prefill that fast, no disk read pays, and a lookup is not waited for.
        fast = policy.describe()
        assert fast["break_even_tokens_wait_disk"] is None or (
            fast["break_even_tokens_wait_disk"] > 6 * PAGE  # type: ignore[operator]
        )
    finally:
        engine.shutdown()
