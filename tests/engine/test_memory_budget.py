"""Admission by memory (engine/scheduling/memory_budget.py), over a tiny cache and no model.

Each test failed on the count-only admission it replaced (commit 1dc760e).
"""

from __future__ import annotations

from scheduler_rig import RigMaker, assert_no_locks, run_until_idle, step, tokens_for

from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Phase, Request
from asynchicache.settings.config import EngineConfig


def _prompt(k: int, pages: int) -> list[int]:
    return tokens_for(*range(k * 100, k * 100 + pages))


def test_requests_are_admitted_while_l1_holds_them_and_none_is_preempted(
    make_rig: RigMaker,
) -> None:
    rig = make_rig(device_pages=16)
    # 5 pages of prompt + 8 answer tokens: 8 pages each with the copy page, two fit.
    eight = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [Request(f"r{k}", _prompt(k, 5), eight) for k in range(4)]
    for req in reqs:
        rig.scheduler.add(req)
    most = 0
    while rig.scheduler.has_work:
        step(rig)
        most = max(most, len(rig.scheduler.running))
    assert all(r.finish_reason == "length" for r in reqs)
    assert rig.scheduler.preemptions == 0
    assert most == 2, f"{most} requests ran at once in room for 2"
    assert_no_locks(rig.cache)


def test_a_preempted_request_waits_until_another_ends(make_rig: RigMaker) -> None:
    # Admission reserves room for one answer token only: decoding outgrows it.
    rig = make_rig(device_pages=12, engine=EngineConfig(min_load_tokens=0, decode_reserve_tokens=1))
    long = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first, second, third = (Request(f"r{k}", _prompt(k, 3), long) for k in range(3))
    for req in (first, second, third):
        rig.scheduler.add(req)
    while rig.scheduler.preemptions == 0:
        step(rig)
    assert second.phase is Phase.WAITING, "the newest running request is the one preempted"
    while first.phase is not Phase.FINISHED:
        step(rig)
        assert second.phase is Phase.WAITING or first.phase is Phase.FINISHED, (
            "the preempted request came back while the shortage lasted"
        )
    run_until_idle(rig)
    assert rig.scheduler.preemptions <= 2
    assert_no_locks(rig.cache)
