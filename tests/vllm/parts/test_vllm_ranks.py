"""Tensor parallelism in the vLLM connector: each rank's heads of a page, and job reports.

A page holds every rank's KV heads (`ranks.py`); rank r copies only its own
slice, and a copy job is done only when every rank reported it.
"""

from __future__ import annotations

import pytest
import torch

from asynchicache.integrations.vllm.layouts.ranks import ReportTally, rank_heads


def test_each_rank_writes_and_reads_only_its_own_heads() -> None:
    # [slots, layers, 2, page_size, 2 ranks x 3 heads, head_dim]
    pool = torch.zeros(4, 2, 2, 16, 6, 8)
    for rank in (0, 1):
        mine = rank_heads(pool, rank, 3)
        assert mine.shape == (4, 2, 2, 16, 3, 8)
        mine.index_copy_(0, torch.tensor([1, 3]), torch.full((2, 2, 2, 16, 3, 8), rank + 1.0))
    assert bool((pool[[1, 3], :, :, :, :3] == 1).all()) and bool(
        (pool[[1, 3], :, :, :, 3:] == 2).all()
    )
    assert bool((pool[[0, 2]] == 0).all())
    assert bool((rank_heads(pool, 1, 3)[3] == 2).all())
    single = torch.zeros(1, 1, 2, 4, 3, 2)
    assert rank_heads(single, 0, 3) is single  # TP 1: the whole page
    with pytest.raises(ValueError, match="rank 2"):
        rank_heads(pool, 2, 3)


def test_a_job_is_done_when_every_rank_reported_and_failed_if_any_failed() -> None:
    tally = ReportTally(2)
    assert tally.add([(7, True), (8, True)]) == []  # rank 0
    assert tally.add([(7, True)]) == [(7, True)]  # rank 1 of job 7
    assert tally.add([(8, False)]) == [(8, False)]  # one rank failed: the job failed
    assert ReportTally(1).add([(9, True), (10, False)]) == [(9, True), (10, False)]
