"""The connector's scheduler side against a real cache service, without a vLLM server.

vLLM's scheduler is played by the test: it calls the connector's methods in
the order vLLM does, and plays the worker by writing the saved pages' bytes
into L2 (as the worker's copy would) and reporting the job done. This makes
the fault cases deterministic: the service frozen after it answered "exists"
and killed while the load into L2 is in flight.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from processes import pid_alive
from vllm_helpers import wait_for

from asynchicache.integrations.vllm import scheduler_side as scheduler_module
from asynchicache.integrations.vllm.block_lookup import Phase, RequestChain
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_process import service_args, service_pid
from asynchicache.integrations.vllm.metadata import AsynchicacheWorkerMeta
from asynchicache.integrations.vllm.namespace import ModelIdentity
from asynchicache.integrations.vllm.scheduler_side import SchedulerSide
from asynchicache.integrations.vllm.spec import VllmKVSpec

BLOCK, PAGE = 32, 16


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class FakeKVManager:
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def spec() -> VllmKVSpec:
    identity = ModelIdentity("tiny-test", "0" * 40, "test", "cpu", "CPU_ATTN:vec", "float32", BLOCK)
    return VllmKVSpec(BLOCK, 64, ("l0", "l1"), 2, 8, torch.float32, identity)


@pytest.fixture
def config(tmp_path: Path) -> ConnectorConfig:
    return ConnectorConfig(
        disk_cache_dir=tmp_path / "kv",
        cache_service=f"ipc://{tmp_path}/run/c.sock",
        host_cache_gb=100_000 / 2**30,
        page_size=PAGE,
        lookup_timeout_s=10.0,
        prefetch_timeout_s=10.0,
        service_start_timeout_s=60.0,
        load_policy="always",  # the tests play vLLM's steps in no time: no measured rates
    )


@pytest.fixture
def side(config: ConnectorConfig) -> Iterator[SchedulerSide]:
    made = SchedulerSide(spec(), config)
    made.kv_cache_manager = FakeKVManager()  # type: ignore[assignment]
    yield made
    made.shutdown()


def answer(side: SchedulerSide, req: FakeRequest, computed: int = 0) -> tuple[int, bool]:
    """Ask as vLLM does, step after step, until the connector knows."""
    got: list[tuple[int | None, bool]] = []

    def known() -> bool:
        got.append(side.get_num_new_matched_tokens(req, computed))
        return got[-1][0] is not None

    wait_for(known, timeout_s=30, what="the lookup's answer")
    tokens, load_async = got[-1]
    assert tokens is not None
    return tokens, load_async


def compute_and_save(
    side: SchedulerSide, req: FakeRequest, blocks: list[int], finish: bool = True
) -> torch.Tensor:
    """vLLM computes the whole prompt in one step; the 'worker' writes its pages into L2.
    Returns the page bytes written, `[pages, layers, 2, PAGE, heads, dim]`."""
    side.on_new_request(req)  # type: ignore[arg-type]
    assert answer(side, req) == (0, False)
    side.update_state_after_alloc(req, FakeBlocks(blocks), 0)  # type: ignore[arg-type]
    side.kv_cache_manager.blocks[req.request_id] = blocks  # type: ignore[union-attr]
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={req.request_id: len(req.all_token_ids)},
    )
    meta = side.build_connector_meta(out)  # type: ignore[arg-type]
    (job,) = meta.saves
    pages = len(req.all_token_ids) // PAGE  # every full page, the last block's in part
    touched = -(-pages // (BLOCK // PAGE))
    assert list(job.block_ids) == blocks[:touched] and len(job.slots) == pages
    assert job.first_page == 0
    pool = side.pool.tensor
    assert pool is not None
    values = torch.randn(len(job.slots), *pool.shape[1:])
    pool[list(job.slots)] = values
    side.on_worker_meta(AsynchicacheWorkerMeta(saves_done=[job.job]))
    if finish:
        side.request_finished(req)  # type: ignore[arg-type]
    return values


def stored(side: SchedulerSide, pages: int) -> None:
    total = 0.0

    def done() -> bool:
        nonlocal total
        stats = side.take_stats()
        total += stats.data.get("pages_stored", 0) if stats else 0
        return total >= pages

    wait_for(done, what=f"{pages} pages stored")


def test_saved_pages_come_back_from_disk_into_a_new_instances_l2(
    side: SchedulerSide, config: ConnectorConfig
) -> None:
    # 5 full blocks, then a block with one full page and 7 tokens
    tokens = list(range(1000, 1000 + 5 * BLOCK + PAGE + 7))
    written = compute_and_save(side, FakeRequest("r1", tokens), [10, 11, 12, 13, 14, 15])
    stored(side, 11)
    side.shutdown()  # L2 and the service go: only the disk keeps the pages
    fresh = SchedulerSide(spec(), config)
    try:
        req = FakeRequest("r2", tokens)
        # Every full page: the hit ends inside vLLM's last block.
        assert answer(fresh, req) == (5 * BLOCK + PAGE, False)
        lk = fresh._lookups["r2"]
        assert lk.split(11).disk == 11
        pool = fresh.pool.tensor
        assert pool is not None
        torch.testing.assert_close(pool[lk.slots], written, rtol=0, atol=0)
        fresh.update_state_after_alloc(req, FakeBlocks([3, 4, 5, 6, 7, 8]), 5 * BLOCK + PAGE)
        meta = fresh.build_connector_meta(
            SimpleNamespace(
                scheduled_new_reqs=[],
                num_scheduled_tokens={},
                scheduled_cached_reqs=SimpleNamespace(
                    req_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
                ),
            )
        )
        (load,) = meta.loads
        assert list(load.block_ids) == [3, 4, 5, 6, 7, 8] and list(load.slots) == lk.slots
        # vLLM already holding the first two blocks: only the rest is offered.
        other = FakeRequest("r3", tokens)
        assert answer(fresh, other, computed=2 * BLOCK) == (3 * BLOCK + PAGE, False)
        fresh.on_worker_meta(AsynchicacheWorkerMeta(loads_done=[load.job]))
        fresh.request_finished(req)  # type: ignore[arg-type]
        fresh.request_finished(other)  # type: ignore[arg-type]
        assert fresh.index.counts()["read"] == 0
        fresh.index.check_integrity()
    finally:
        fresh.shutdown()


def test_later_steps_save_the_pages_they_complete(side: SchedulerSide) -> None:
    """Output tokens fill pages inside a block: each step saves the pages it completed,
    from inside the block, and a prompt that repeats them hits them all in L2."""
    tokens = list(range(400, 400 + BLOCK + PAGE + 3))  # 3 full pages, 3 tokens more
    req = FakeRequest("grow", tokens)
    compute_and_save(side, req, [7, 8], finish=False)
    side.kv_cache_manager.blocks["grow"] = [7, 8, 9]  # type: ignore[union-attr]
    req.all_token_ids = tokens + list(range(9000, 9000 + 2 * PAGE))  # decoded (one step here)
    meta = side.build_connector_meta(
        SimpleNamespace(  # type: ignore[arg-type]
            scheduled_new_reqs=[],
            num_scheduled_tokens={"grow": 2 * PAGE},
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["grow"], resumed_req_ids=set(), num_computed_tokens=[len(tokens)]
            ),
        )
    )
    (job,) = meta.saves  # pages 3 (block 8's second) and 4 (block 9's first)
    assert (job.block_ids, job.first_page, len(job.slots)) == ((8, 9), 1, 2)
    side.on_worker_meta(AsynchicacheWorkerMeta(saves_done=[job.job]))
    side.request_finished(req)  # type: ignore[arg-type]
    again = FakeRequest("again", [*req.all_token_ids, 5])
    assert answer(side, again) == (5 * PAGE, False)
    assert side._lookups["again"].split(5).host == 5
    side.request_finished(again)  # type: ignore[arg-type]
    stored(side, 5)
    assert side.index.counts()["read"] == 0
    side.index.check_integrity()


def test_salted_chains_do_not_meet(side: SchedulerSide) -> None:
    tokens = list(range(50, 50 + 3 * BLOCK + 1))
    compute_and_save(side, FakeRequest("a", tokens, cache_salt="tenant-a"), [1, 2, 3, 4])
    stored(side, 6)
    assert answer(side, FakeRequest("b", tokens, cache_salt="tenant-b")) == (0, False)
    assert answer(side, FakeRequest("c", tokens)) == (0, False)
    assert answer(side, FakeRequest("d", tokens, cache_salt="tenant-a")) == (3 * BLOCK, False)


def _empty_step() -> SimpleNamespace:
    """A SchedulerOutput that scheduled nothing (ends one schedule() call)."""
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={}
    )


def _prompt(name: str, first_token: int) -> FakeRequest:
    return FakeRequest(name, list(range(first_token, first_token + 2 * BLOCK + 1)))


def _spy_asks(side: SchedulerSide, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lookup keys `side` asks the service about, from now on."""
    asked: list[int] = []
    ask = side.link.ask_exists
    monkeypatch.setattr(side.link, "ask_exists", lambda key, h: (asked.append(key), ask(key, h)))
    return asked


def test_requests_arriving_together_are_asked_about_at_once_and_answered_in_one_step(
    side: SchedulerSide, config: ConnectorConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of prompts: each lookup starts on arrival, so the scheduler's first visit
    of each, all in one step, has its answer (a lookup started only at the visit took a
    step per request beyond the first, and vLLM ran a burst of cold prompts in smaller
    steps than without the connector). A disk hit's pages are read into L2 at arrival
    too (they used to wait for the visit, which then waited a step for the read)."""
    on_disk = _prompt("on-disk", 900)
    fresh = on_disk_only(side, config, on_disk.all_token_ids)
    try:
        asked = _spy_asks(fresh, monkeypatch)
        loads: list[int] = []
        load = fresh.link.load
        monkeypatch.setattr(
            fresh.link, "load", lambda job, h, s: (loads.append(job), load(job, h, s))
        )
        monkeypatch.setattr(scheduler_module, "_YIELD_S", 10.0)  # one step's wait, slow hosts
        fresh.build_connector_meta(_empty_step())  # type: ignore[arg-type]
        burst = [on_disk, _prompt("new-1", 100), _prompt("new-2", 200)]
        for req in burst:
            fresh.on_new_request(req)  # type: ignore[arg-type]
        assert len(asked) == 3  # before the scheduler reached any of them
        wait_for(lambda: (fresh._poll(), bool(loads))[1], what="the read at arrival")
        assert len(loads) == 1  # the disk hit's read started before the visit
        got = [fresh.get_num_new_matched_tokens(req, 0) for req in burst]  # type: ignore[arg-type]
        assert got == [(2 * BLOCK, False), (0, False), (0, False)]
        assert len(asked) == 3  # answered, not asked again
        assert len(loads) == 1
    finally:
        fresh.shutdown()


def test_lookups_start_on_arrival_only_up_to_a_bound(
    side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `EARLY_LOOKUPS` requests not yet reached by the scheduler, a lookup starts
    when the scheduler reaches the request (early lookups pin their L2 pages)."""
    monkeypatch.setattr(scheduler_module, "EARLY_LOOKUPS", 2)
    asked = _spy_asks(side, monkeypatch)
    reqs = [_prompt(f"q-{i}", i * 100) for i in range(4)]
    for req in reqs[:3]:
        side.on_new_request(req)  # type: ignore[arg-type]
    assert len(asked) == 2
    assert answer(side, reqs[0]) == (0, False)  # reached: room for another early one
    side.on_new_request(reqs[3])  # type: ignore[arg-type]
    assert len(asked) == 3
    assert answer(side, reqs[2]) == (0, False)  # started when reached
    assert len(asked) == 4


def test_service_killed_mid_load_is_a_miss_then_hits_resume(
    side: SchedulerSide, config: ConnectorConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No sleeping for the answer inside a call: the test steps between "exists"
    # answered and the load sent.
    monkeypatch.setattr(scheduler_module, "_YIELD_S", 0.0)
    tokens = list(range(7, 7 + 4 * BLOCK + 1))
    compute_and_save(side, FakeRequest("w", tokens), [1, 2, 3, 4, 5])
    stored(side, 8)
    # Only the disk has the pages: drop them from L2 by filling it with other saves.
    hashes = RequestChain(side.namespace.digest(), PAGE).extend(tokens)[:8]
    n = 0
    while any(side.index.slot_of(h) is not None for h in hashes):
        n += 1
        compute_and_save(
            side, FakeRequest(f"f{n}", [n * 7919 + i for i in range(4 * BLOCK)]), [1, 2, 3, 4]
        )
    pid = service_pid(config.service_address)
    assert pid is not None
    req = FakeRequest("r", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # "exists" asked
    wait_for(side.link.has_events, what="the service's answer")
    os.kill(pid, signal.SIGSTOP)  # frozen: the read it is about to get never starts
    try:
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        assert side._lookups["r"].phase is Phase.LOADING
        writing = side.index.counts()["writing"]
        assert writing == 8  # the prefetch's slots, quarantined while the service may write
    finally:
        os.kill(pid, signal.SIGKILL)  # (a stopped service would never stop by itself)
    assert answer(side, req) == (0, False)  # a miss: vLLM recomputes
    wait_for(
        lambda: side._poll() or side.index.counts()["writing"] == 0,
        what="the dead service's slots released",
    )
    side.index.check_integrity()
    side.request_finished(req)  # type: ignore[arg-type]
    # The connector starts a new service; the disk still has the pages.
    wait_for(
        lambda: (p := service_pid(config.service_address)) not in (None, pid) and pid_alive(p),
        timeout_s=60,
        what="a new service",
    )
    wait_for(lambda: side.link.connected, timeout_s=60, what="the link to reconnect")
    assert answer(side, FakeRequest("again", tokens)) == (4 * BLOCK, False)


def test_two_instances_on_one_machine_share_one_service(
    side: SchedulerSide, config: ConnectorConfig
) -> None:
    tokens = list(range(300, 300 + 2 * BLOCK + 1))
    compute_and_save(side, FakeRequest("first", tokens), [1, 2, 3])
    stored(side, 4)
    pid = service_pid(config.service_address)
    second = SchedulerSide(spec(), config)  # another vLLM: its own L2 segment, same service
    try:
        assert second.pool.name != side.pool.name
        assert answer(second, FakeRequest("from-first", tokens)) == (2 * BLOCK, False)
        assert service_pid(config.service_address) == pid  # none started for it
    finally:
        second.shutdown()


def test_a_service_we_start_reads_through_the_page_cache_unless_asked() -> None:
    # A restart reads back pages written moments before: the page cache holds them.
    assert "--no-direct-io" in service_args(ConnectorConfig())
    direct = ConnectorConfig.from_extra({"direct_io": "true"})
    assert "--no-direct-io" not in service_args(direct)


def on_disk_only(
    side: SchedulerSide, config: ConnectorConfig, tokens: list[int], **changes: float
) -> SchedulerSide:
    """`tokens` computed and stored by `side`, which then goes (its L2 and service with
    it): a new instance with `changes` to the config finds the pages on disk only."""
    blocks = list(range(1, 2 + len(tokens) // BLOCK))
    compute_and_save(side, FakeRequest("saver", tokens), blocks)
    stored(side, len(tokens) // PAGE)
    side.shutdown()
    return SchedulerSide(spec(), dataclasses.replace(config, **changes))


def events(side: SchedulerSide, name: str) -> float:
    stats = side.take_stats()
    return stats.data.get(name, 0) if stats else 0


def test_a_lookup_waits_for_l2_room_then_reads_every_page(
    side: SchedulerSide, config: ConnectorConfig
) -> None:
    """L2 full of slots in use (stores and copies in flight) frees up within a step or
    two: the lookup waits for room (vLLM asks again) instead of recomputing."""
    tokens = list(range(2000, 2000 + 5 * BLOCK + 1))  # 10 pages
    fresh = on_disk_only(side, config, tokens)
    try:
        busy = fresh.index.allocate(fresh.index.num_slots)
        assert busy is not None
        req = FakeRequest("r", tokens)

        def waits_for_room() -> bool:
            got = fresh.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
            return got == (None, False) and fresh._lookups["r"].phase is Phase.ROOM

        wait_for(waits_for_room, what="the service's answer, L2 full")
        for _ in range(3):  # steps go by: no answer while L2 has no room
            assert waits_for_room()
        fresh.index.release(busy)
        assert answer(fresh, req) == (5 * BLOCK, False)
        assert fresh._lookups["r"].split(10).disk == 10
        assert events(fresh, "loads_skipped") == 0
        fresh.request_finished(req)  # type: ignore[arg-type]
        fresh.index.check_integrity()
    finally:
        fresh.shutdown()


def test_l2_without_room_by_the_deadline_is_a_counted_miss(
    side: SchedulerSide, config: ConnectorConfig
) -> None:
    tokens = list(range(3000, 3000 + 5 * BLOCK + 1))
    fresh = on_disk_only(side, config, tokens, prefetch_timeout_s=0.3)
    try:
        busy = fresh.index.allocate(fresh.index.num_slots)
        assert busy is not None
        assert answer(fresh, FakeRequest("r", tokens)) == (0, False)  # vLLM recomputes
        assert events(fresh, "loads_skipped") == 10
        fresh.index.release(busy)
        assert answer(fresh, FakeRequest("again", tokens)) == (5 * BLOCK, False)
        fresh.index.check_integrity()
    finally:
        fresh.shutdown()


def test_a_chain_longer_than_l2_is_read_as_far_as_l2_holds(
    side: SchedulerSide, config: ConnectorConfig
) -> None:
    """A 10-page chain and a 6-slot L2: a 6-page hit (it used to be none at all)."""
    pool = side.pool.tensor
    assert pool is not None
    page_bytes = pool[0].numel() * pool.element_size()
    tokens = list(range(4000, 4000 + 5 * BLOCK + 1))
    fresh = on_disk_only(side, config, tokens, host_cache_gb=6.5 * page_bytes / 2**30)
    try:
        assert fresh.index.num_slots == 6
        assert answer(fresh, FakeRequest("r", tokens)) == (6 * PAGE, False)
        assert events(fresh, "loads_skipped") == 4
    finally:
        fresh.shutdown()
