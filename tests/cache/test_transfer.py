"""The transfer engine: runs, batched copies, non-blocking poll, failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from asynchicache.hierarchy.l2.transfer import TransferEngine, copy_pages, page_runs

SHAPE = (2, 2, 4, 1, 4)  # [layers, 2, page_size, kv_heads, head_dim]


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    e = TransferEngine(torch.device("cpu"))
    yield e
    e.close()


def _pools(n_src: int = 16, n_dst: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.arange(n_src * 64, dtype=torch.float32).view(n_src, *SHAPE)
    return src, torch.zeros(n_dst, *SHAPE)


def test_page_runs_groups_consecutive_pairs() -> None:
    assert page_runs([], []) == []
    assert page_runs([3, 4, 5], [0, 1, 2]) == [(3, 0, 3)]
    assert page_runs([3, 4, 9, 10, 11], [7, 8, 9, 1, 2]) == [(3, 7, 2), (9, 9, 1), (10, 1, 2)]
    assert page_runs([5, 4], [0, 1]) == [(5, 0, 1), (4, 1, 1)]
    with pytest.raises(ValueError):
        page_runs([1], [])


def test_copy_pages_writes_into_the_destination_not_a_temporary() -> None:
    src, dst = _pools()
    mapping = [(3, 10), (4, 11), (0, 2), (15, 0), (7, 7)]
    copy_pages(src, [s for s, _ in mapping], dst, [d for _, d in mapping])
    for s, d in mapping:
        assert torch.equal(dst[d], src[s])
    untouched = set(range(16)) - {d for _, d in mapping}
    assert all(dst[p].eq(0).all() for p in untouched)


def test_submit_poll_wait(engine: TransferEngine) -> None:
    src, dst = _pools()
    t1 = engine.submit(src, [1, 2, 3], dst, [5, 6, 7])
    t2 = engine.submit(src, [9], dst, [0])
    assert engine.num_pending == 2
    done = []
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        done += engine.poll()
    assert [d.ticket for d in done] == [t1, t2]
    assert all(d.ok for d in done)
    assert done[0].num_pages == 3 and done[0].num_bytes == 3 * 64 * 4
    assert torch.equal(dst[5:8], src[1:4]) and torch.equal(dst[0], src[9])
    t3 = engine.submit(src, [4], dst, [4])
    result = engine.wait(t3)
    assert result.ok and result.ticket == t3
    assert engine.poll() == []  # a waited ticket is not reported again


def test_poll_does_not_block_on_a_large_copy(engine: TransferEngine) -> None:
    big_src = torch.ones(64, 64, 1024)  # 16 MiB
    big_dst = torch.zeros(64, 64, 1024)
    blocker = engine.submit(big_src, list(range(64)), big_dst, list(range(64)))
    many = [engine.submit(big_src, list(range(64)), big_dst, list(range(64))) for _ in range(4)]
    start = time.perf_counter()
    reported = {d.ticket for d in engine.poll()}  # a fast machine may finish the first one
    assert time.perf_counter() - start < 0.05
    for t in [blocker, *many]:
        if t not in reported:
            engine.wait(t)
    assert big_dst.eq(1).all()


def test_failed_copy_is_reported_and_the_worker_survives(engine: TransferEngine) -> None:
    src, dst = _pools()
    wrong = torch.zeros(4, 3)  # pages of another shape
    bad = engine.submit(src, [0], wrong, [0])
    result = engine.wait(bad)
    assert not result.ok and result.error
    good = engine.submit(src, [2], dst, [3])
    assert engine.wait(good).ok
    assert torch.equal(dst[3], src[2])
    with pytest.raises(ValueError):
        engine.submit(src, [0, 1], dst, [0])


def test_an_urgent_copy_goes_before_background_ones(engine: TransferEngine) -> None:
    """A load (urgent) overtakes write-throughs queued before it, even mid-copy."""
    big_src = torch.ones(256, 64, 1024)  # 64 MiB: 16 pieces of SLICE_PAGES pages
    big_dst = torch.zeros(256, 64, 1024)
    writes = [engine.submit(big_src, list(range(256)), big_dst, list(range(256))) for _ in range(3)]
    src, dst = _pools()
    load = engine.submit(src, [1], dst, [2], urgent=True)
    assert engine.wait(load).ok and torch.equal(dst[2], src[1])
    # When the load was done, the background copies were not: it did not wait for them.
    # One poll: poll() hands each result over once, so polling per ticket could
    # report a write done (and forget it) and then `wait` for it below.
    reported = {d.ticket for d in engine.poll()}
    unfinished = [t for t in writes if t not in reported]
    assert unfinished, "the load waited for every write queued before it"
    for t in unfinished:
        assert engine.wait(t).ok
    assert big_dst.eq(1).all()


def test_an_urgent_copy_is_done_when_submit_returns(engine: TransferEngine) -> None:
    """A load's L2 -> L1 copy does not wait for the copy thread to be scheduled (issue 41:
    on busy cores the thread came too late for the step that admitted the hit, which then
    waited a whole step): it is copied by the caller, while a background copy is in flight."""
    gate = threading.Event()
    busy = engine._worker.submit([lambda: gate.wait(10)])  # a stalled write
    try:
        src, dst = _pools()
        load = engine.submit(src, [3, 4], dst, [0, 1], urgent=True)
        assert [d.ticket for d in engine.poll()] == [load]
        assert torch.equal(dst[:2], src[3:5])
    finally:
        gate.set()
    busy.result(timeout=10)
