"""Prefetch at arrival (engine/scheduling/prefetch.py): a queued request's storage prefix
moves into L2 while it waits, so by admission it is an L2 hit; every lock and read is
released whatever the request's fate. The scheduler over a tiny cache and an in-memory
storage tier."""

from __future__ import annotations

from scheduler_rig import (
    PAGE,
    Rig,
    RigMaker,
    assert_no_locks,
    cached_prefix,
    run_until_idle,
    step,
    tokens_for,
)

from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Phase, Request
from asynchicache.settings.config import EngineConfig

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
ONE_AT_A_TIME = EngineConfig(min_load_tokens=0, max_running_requests=1)


def _rig(make_rig: RigMaker, arrival: bool = True, **kw: object) -> Rig:
    kw = {"device_pages": 16, "host_slots": 16, "engine": ONE_AT_A_TIME, **kw}
    return make_rig(storage=True, arrival_prefetch=arrival, **kw)


def _settled(rig: Rig) -> None:
    """No lock, read or hold left once the stores waiting for a quiet engine ran."""
    rig.cache.drain()
    assert_no_locks(rig.cache)


def _on_disk_only(rig: Rig, *ids: int) -> list[int]:
    prefix = tokens_for(*ids)
    cached_prefix(rig, prefix)
    rig.cache.clear()  # L1 and L2 emptied: the pages live in storage only
    assert rig.cache.lookup(prefix)["disk"] == len(prefix)
    return prefix


def _queued_behind_a_running_request(rig: Rig) -> Request:
    prefix = _on_disk_only(rig, 1, 2, 3)
    first = Request("first", [*tokens_for(9), 5], GREEDY)
    rig.scheduler.add(first)
    step(rig)
    assert first.phase is Phase.RUNNING
    queued = Request("queued", [*prefix, 7], GREEDY)
    rig.scheduler.add(queued)
    return queued


def test_a_queued_request_finds_its_disk_prefix_in_l2_at_admission(make_rig: RigMaker) -> None:
    rig = _rig(make_rig)
    queued = _queued_behind_a_running_request(rig)
    assert rig.scheduler.prefetcher.in_flight == 1, "no read started at arrival"
    step(rig)  # the read lands while `first` still runs
    assert queued.phase is Phase.WAITING
    assert rig.cache.lookup(queued.prompt)["host"] == 3 * PAGE
    read_before = rig.cache.stats().counters.storage_to_host_pages
    run_until_idle(rig)
    counters = rig.cache.stats().counters
    assert counters.storage_to_host_pages == read_before, "admission read the disk again"
    assert counters.host_hit_tokens == 3 * PAGE, "admission did not find the prefix in L2"
    # Its usage names the tier the bytes came from: the read was its own, only earlier.
    assert (queued.cached.host, queued.cached.disk) == (0, 3 * PAGE)
    assert (counters.prefetches, counters.prefetched_pages) == (1, 3)
    _settled(rig)


def test_without_arrival_prefetch_the_same_request_reads_the_disk_at_admission(
    make_rig: RigMaker,
) -> None:
    rig = _rig(make_rig, arrival=False)
    queued = _queued_behind_a_running_request(rig)
    assert rig.scheduler.prefetcher.in_flight == 0
    run_until_idle(rig)
    assert (queued.cached.host, queued.cached.disk) == (0, 3 * PAGE)
    counters = rig.cache.stats().counters
    assert counters.prefetches == 0 and counters.host_hit_tokens == 0
    _settled(rig)


def test_a_request_admitted_while_its_read_lands_waits_for_it(make_rig: RigMaker) -> None:
    rig = _rig(make_rig, engine=EngineConfig(min_load_tokens=0))
    assert rig.storage is not None
    prefix = _on_disk_only(rig, 1, 2, 3)
    rig.storage.hold = True  # the read is slow
    slow = Request("slow", [*prefix, 7], GREEDY)
    rig.scheduler.add(slow)
    other = Request("other", [*tokens_for(8), 5], GREEDY)
    rig.scheduler.add(other)
    step(rig)
    assert slow in rig.scheduler.landing and other.phase is Phase.RUNNING  # FIFO kept
    assert rig.scheduler.queue_lengths()["loading"] == 1
    rig.storage.hold = False
    run_until_idle(rig)
    assert (slow.cached.host, slow.cached.disk) == (0, 3 * PAGE)
    assert rig.storage.loads == 3, "the pages were read twice"
    _settled(rig)


def test_an_abort_while_the_read_runs_releases_everything(make_rig: RigMaker) -> None:
    rig = _rig(make_rig)
    assert rig.storage is not None
    queued = _queued_behind_a_running_request(rig)
    rig.storage.hold = True
    rig.scheduler.abort("queued")
    assert queued.phase is Phase.FINISHED
    rig.storage.hold = False
    run_until_idle(rig)
    assert rig.scheduler.prefetcher.stats()["used_pages"] == 0
    _settled(rig)


def test_an_abort_after_the_read_landed_unlocks_its_pages(make_rig: RigMaker) -> None:
    rig = _rig(make_rig)
    queued = _queued_behind_a_running_request(rig)
    step(rig)  # landed, held for the request
    rig.scheduler.abort("queued")
    run_until_idle(rig)
    _settled(rig)
    assert rig.cache.lookup(queued.prompt)["host"] == 3 * PAGE, "the landed pages stay cached"


def test_a_late_read_is_given_up_and_the_request_admitted(make_rig: RigMaker) -> None:
    rig = _rig(make_rig, prefetch_policy="timeout", prefetch_timeout_s=1e-9,
               engine=EngineConfig(min_load_tokens=0))  # fmt: skip
    assert rig.storage is not None
    prefix = _on_disk_only(rig, 1, 2, 3)
    rig.storage.hold = True
    rig.storage.cancellable = False  # it lands anyway, and is released by the cache
    req = Request("r", [*prefix, 7], GREEDY)
    rig.scheduler.add(req)
    step(rig)
    assert rig.scheduler.prefetcher.given_up == 1
    assert req.phase is not Phase.WAITING
    rig.storage.hold = False
    run_until_idle(rig)
    assert req.finish_reason == "length"
    _settled(rig)


def test_the_budget_bounds_each_request_and_all_of_them(make_rig: RigMaker) -> None:
    rig = _rig(make_rig, host_slots=8)  # budget 4 pages, 2 a request
    assert rig.storage is not None
    prompts = [_on_disk_only(rig, k, k + 10, k + 20) for k in (1, 2, 3)]
    rig.storage.hold = True
    for i, prompt in enumerate(prompts):
        rig.scheduler.add(Request(f"r{i}", [*prompt, 7], GREEDY))
    prefetcher = rig.scheduler.prefetcher
    assert (prefetcher.budget, prefetcher.per_request) == (4, 2)
    assert prefetcher.used == 4 and prefetcher.over_budget == 1
    rig.storage.hold = False
    run_until_idle(rig)
    assert prefetcher.used == 0
    _settled(rig)


def test_a_request_that_arrived_over_budget_is_prefetched_while_it_waits(
    make_rig: RigMaker,
) -> None:
    rig = _rig(make_rig, host_slots=8)  # budget 4 pages, 2 a request; one request runs
    prompts = [_on_disk_only(rig, k, k + 10) for k in (1, 2, 3)]
    reqs = [Request(f"r{i}", [*p, 7], GREEDY) for i, p in enumerate(prompts)]
    for req in reqs:
        rig.scheduler.add(req)
    assert rig.cache.stats().counters.prefetches == 2  # the third waits for budget
    run_until_idle(rig)
    counters = rig.cache.stats().counters
    assert counters.prefetches == 3, "the queued request was never prefetched"
    assert counters.host_hit_tokens == 3 * 2 * PAGE  # each found its prefix in L2
    assert [r.cached.disk for r in reqs] == [2 * PAGE] * 3
    _settled(rig)


def test_the_read_deadline_counts_from_admission_not_arrival(make_rig: RigMaker) -> None:
    import time

    rig = _rig(make_rig, prefetch_policy="timeout", prefetch_timeout_s=0.5)
    assert rig.storage is not None
    prefix = _on_disk_only(rig, 1, 2, 3)
    rig.scheduler.add(Request("first", [*tokens_for(9), 5], GREEDY))
    step(rig)
    rig.storage.hold = True  # the read is slow
    queued = Request("queued", [*prefix, 7], GREEDY)
    rig.scheduler.add(queued)
    time.sleep(0.6)  # longer in the queue than the timeout
    rig.scheduler.abort("first")  # its slot frees: `queued` is admitted, its read still out
    step(rig)
    assert queued in rig.scheduler.landing and rig.scheduler.prefetcher.given_up == 0
    rig.storage.hold = False
    run_until_idle(rig)
    assert rig.scheduler.prefetcher.given_up == 0
    assert rig.cache.stats().counters.host_hit_tokens == 3 * PAGE
    _settled(rig)
