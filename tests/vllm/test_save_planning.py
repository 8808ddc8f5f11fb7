"""Save planning (saves.py) on a real L2 slot index: what a step copies, what it skips.

Pages the service holds (a lookup was told so) are not copied again; when L2
has no room the plan stops at the first page it cannot place and the next
step places it once L2 has room; pages never placed by the request's end are
counted. (Under vLLM's real schedulers: test_scheduling_modes.py.)
"""

from __future__ import annotations

from asynchicache.hierarchy.l2.host_index import HostIndex
from asynchicache.integrations.vllm.block_lookup import RequestChain
from asynchicache.integrations.vllm.connector_jobs import Job
from asynchicache.integrations.vllm.connector_stats import AsynchicacheStats
from asynchicache.integrations.vllm.saves import SavePlanner, saveable_tokens

PAGE, PER_BLOCK = 16, 2
TOKENS = list(range(100, 100 + 8 * PAGE))  # 8 pages, 4 blocks
BLOCKS = [40, 41, 42, 43]  # the request's vLLM blocks


def planner(slots: int) -> tuple[SavePlanner, HostIndex, AsynchicacheStats, list[Job]]:
    index, stats, jobs = HostIndex(slots), AsynchicacheStats(), []

    def register(job: Job) -> int:
        jobs.append(job)
        return len(jobs)

    return SavePlanner(PAGE, PER_BLOCK, index, stats, register), index, stats, jobs


def pages_of(planned: list) -> list[int]:
    """The page numbers a plan's copy jobs cover (from their blocks and first page)."""
    out = []
    for job in planned:
        start = BLOCKS.index(job.block_ids[0]) * PER_BLOCK + job.first_page
        out += list(range(start, start + len(job.slots)))
    return out


def test_the_known_tokens_bound_what_a_step_saves() -> None:
    assert saveable_tokens(computed=47, scheduled=1, known=47) == 47  # async: lags
    assert saveable_tokens(computed=47, scheduled=5, known=48) == 48  # 4 drafts
    assert saveable_tokens(computed=0, scheduled=40, known=100) == 40  # a prefill chunk


def test_pages_the_service_holds_are_not_copied_again() -> None:
    plan, _, _, _ = planner(32)
    chain = RequestChain(b"r" * 16, PAGE)
    plan.service_holds("r", range(2, 5))  # the lookup was told: pages 2-4 exist on disk
    plan.start("r", 0)
    planned = plan.plan("r", chain, TOKENS, 8 * PAGE, BLOCKS)
    assert pages_of(planned) == [0, 1, 5, 6, 7]


def test_pages_l2_had_no_room_for_are_saved_once_it_has() -> None:
    plan, index, stats, jobs = planner(4)
    chain = RequestChain(b"r" * 16, PAGE)
    held = index.allocate(3)  # other work holds 3 of the 4 slots
    assert held is not None
    plan.start("r", 0)
    first = plan.plan("r", chain, TOKENS, 4 * PAGE, BLOCKS)
    assert first == [] and stats.data["saves_deferred"] == 1  # 4 pages, 1 free slot
    index.release(held)  # room again
    second = plan.plan("r", chain, TOKENS, 4 * PAGE, BLOCKS)
    assert pages_of(second) == [0, 1, 2, 3]  # the deferred pages, from the first one
    for job in jobs:
        index.release(job.slots)
    later = plan.plan("r", chain, TOKENS, 8 * PAGE, BLOCKS)
    assert pages_of(later) == [4, 5, 6, 7]
    plan.finish("r")
    assert "saves_skipped" not in stats.data  # every due page was placed


def test_pages_never_placed_are_counted_when_the_request_ends() -> None:
    plan, index, stats, _ = planner(4)
    chain = RequestChain(b"r" * 16, PAGE)
    assert index.allocate(4) is not None  # L2 full for good
    plan.start("r", 2 * PAGE)  # vLLM held the first two pages (its own prefix cache)
    assert plan.plan("r", chain, TOKENS, 7 * PAGE, BLOCKS) == []
    plan.finish("r")
    assert stats.data["saves_skipped"] == 5  # pages 2-6
