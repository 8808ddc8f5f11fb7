"""The connector's load policy (integrations/vllm/load_policy.py) on fixed rates, and
its step clock, without vLLM."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from asynchicache.hierarchy.load_cost import Rate
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.load_policy import (
    DISK,
    HOST,
    REMOTE,
    LoadPolicy,
    StepClock,
    copy_rate,
)

PAGE = 16


def policy(tmp_path: Path, **changes: object) -> LoadPolicy:
    """1 MB pages: 16 ms to recompute one at 1,000 tokens/s, 1 ms to copy from L2 at
    1 GB/s, 10 ms to read from disk at 100 MB/s; a step of 0.1 s."""
    config = ConnectorConfig(disk_cache_dir=tmp_path, page_size=PAGE, **changes)  # type: ignore[arg-type]
    made = LoadPolicy.measured(torch.zeros(4, 250_000), config)
    made.cost.prefill_tok_s = Rate(1000.0, weight=0.0)
    made.step_s = Rate(0.1, weight=0.0)
    made.cost.bandwidth[HOST].value = 1e9
    made.cost.bandwidth[DISK].value = 1e8
    return made


def test_each_decision_counts_what_is_left_to_pay(tmp_path: Path) -> None:
    p = policy(tmp_path)
    assert p.cost.page_bytes == 1_000_000
    # A verified L2 hit: a copy (1 ms a page) against 16 ms a page: one page pays.
    assert p.pays(1) and p.break_even_tokens(HOST) == PAGE
    # Read from disk then copied: 11 ms against 16 ms a page: one page pays.
    assert p.pays(1, DISK) and p.break_even_tokens(DISK) == PAGE
    # Waiting a step (0.1 s) for a disk read: 5 ms saved a page, 21 pages pay.
    assert p.break_even_tokens(DISK, wait=True) == 21 * PAGE
    assert p.pays(21, DISK, wait=True) and not p.pays(20, DISK, wait=True)
    assert not p.pays(0)


def test_asynchronous_loads_cost_a_step_and_always_loads_everything(tmp_path: Path) -> None:
    slow = policy(tmp_path, load_async=True)
    assert slow.break_even_tokens(HOST) == 7 * PAGE  # 15 ms a page against a 0.1 s step
    assert not slow.pays(6) and slow.pays(7)
    always = policy(tmp_path, load_policy="always", min_load_tokens=2 * PAGE)
    assert always.pays(500, REMOTE, wait=True) and always.pays(2, DISK, wait=True)
    assert not always.pays(1)  # min_load_tokens still holds
    assert always.describe()["policy"] == "always"


def test_the_l2_copy_rate_is_timed_at_start() -> None:
    assert copy_rate(torch.zeros(8, 1024)) > 1e6  # bytes/s, any host copies faster


def test_the_step_clock_times_a_step_from_its_jobs_reports(tmp_path: Path) -> None:
    p = policy(tmp_path)
    p.cost.prefill_tok_s.weight = p.step_s.weight = 1.0  # the last observation
    clock = StepClock(p)
    clock.scheduled([1, 2], {"a": 300, "b": 1})
    time.sleep(0.05)
    clock.reported([2, 1])
    assert 0.05 <= p.step_s.value < 1.0
    assert 301 / 1.0 < p.cost.prefill_tok_s.value <= 301 / 0.05
    # A decode-only step times the step but not the prefill rate.
    prefill = p.cost.prefill_tok_s.value
    clock.scheduled([3], {"a": 1, "b": 1})
    clock.reported([3])
    assert p.cost.prefill_tok_s.value == prefill and p.step_s.value < 0.05
    clock.scheduled([], {"a": 500})  # no jobs: not timed
    clock.reported([4])
    assert p.cost.prefill_tok_s.value == prefill
