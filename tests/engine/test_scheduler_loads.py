"""The scheduler over a tiny cache (no model): loads it gives up, collects and abandons.

Issue 11, defects 2, 3 and 7.
"""

from __future__ import annotations

from scheduler_rig import (
    PAGE,
    RigMaker,
    assert_no_locks,
    cached_prefix,
    run_until_idle,
    step,
    tokens_for,
)

from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Phase, Request

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
LATE = {"prefetch_policy": "timeout", "prefetch_timeout_s": 1e-9}  # every load is late


def test_a_landed_load_is_collected_before_late_loads_are_given_up(make_rig: RigMaker) -> None:
    rig = make_rig(**LATE)
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.evict(8)  # only in L2 now
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    rig.cache.transfer.flush()  # the load has landed; its deadline has passed too
    step(rig)
    assert req.cached.host == 3 * PAGE, "a load that had landed was thrown away"
    run_until_idle(rig)
    assert_no_locks(rig.cache)


def test_a_prefix_evicted_while_its_load_waits_for_room_is_recomputed(
    make_rig: RigMaker,
) -> None:
    rig = make_rig(**LATE)
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.evict(8)  # only in L2 now
    busy = rig.cache.allocate(8)  # running requests hold all of L1: the load finds no room
    assert busy is not None
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.WAITING, "a load started without L1 room"
    rig.cache.evict_host(4)  # L2 pressure (e.g. a write-through) takes the host-only prefix
    step(rig)
    rig.cache.free(busy)
    run_until_idle(rig)
    assert req.finish_reason == "length" and req.cached.total == 0
    assert_no_locks(rig.cache)


def test_a_given_up_load_counts_as_work_until_it_lands_and_is_released(
    make_rig: RigMaker,
) -> None:
    rig = make_rig(storage=True, **LATE)
    assert rig.storage is not None
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.clear()  # only in storage now
    rig.storage.hold = True
    rig.storage.cancellable = False  # the service has started the read: it will land
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    step(rig)  # late: given up, recomputed
    while req.phase is not Phase.FINISHED:
        step(rig)
    assert req.cached.disk == 0
    assert rig.scheduler.has_work, "a load still in flight is not counted as work"
    rig.storage.hold = False
    run_until_idle(rig)
    assert_no_locks(rig.cache)
    rig.cache.clear()
    stats = rig.cache.stats()
    assert stats.device.cached == 0 and stats.host is not None and stats.host.cached == 0


def test_an_aborted_loading_request_releases_everything(make_rig: RigMaker) -> None:
    rig = make_rig(storage=True)
    assert rig.storage is not None
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.clear()
    rig.storage.hold = True
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert req.phase is Phase.LOADING
    assert rig.scheduler.abort("r")
    assert req.phase is Phase.FINISHED
    rig.storage.hold = False
    run_until_idle(rig)
    rig.cache.drain()
    assert_no_locks(rig.cache)


# Failed on the count-only admission (commit 1dc760e): the load fell short instead.
def test_a_load_waits_for_l1_room_instead_of_recomputing(make_rig: RigMaker) -> None:
    rig = make_rig(device_pages=8)
    prefix = tokens_for(1, 2, 3)
    cached_prefix(rig, prefix)
    rig.cache.evict(8)  # only in L2 now
    busy = rig.cache.allocate(7)  # L1 held elsewhere (as copies in flight pin it)
    assert busy is not None
    req = Request("r", [*prefix, 7], SamplingParams(max_tokens=2, temperature=0.0))
    rig.scheduler.add(req)
    step(rig)
    step(rig)
    assert req.phase is Phase.WAITING, "the load started without room (and fell short)"
    assert rig.scheduler.loads_deferred >= 1
    rig.cache.free(busy)
    run_until_idle(rig)
    assert req.cached.host == 3 * PAGE, "the prefix held by L2 was recomputed"
    assert_no_locks(rig.cache)
