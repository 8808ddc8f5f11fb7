"""Tensor parallelism: every rank's K/V heads in one page, each rank copying its own.

vLLM splits a layer's KV heads over its tensor-parallel ranks (rank r holds
heads r*h .. r*h + h - 1 of the model's, h = heads per rank; a model with
fewer KV heads than ranks replicates them, and each rank still holds h). Our
page holds all ranks' heads, `[layers, 2, page_size, tp * h, head_dim]`:

* the scheduler side names and looks up one page per position, as at TP 1
  (the namespace names the TP size: the arithmetic differs per size);
* each rank's worker copies between its blocks and its own head slice of the
  L2 slots (`rank_heads`), never another rank's;
* a copy job is done when every rank reported it (`ReportTally`): a page is
  published only once all ranks wrote their heads, and a load's pins stay
  until all ranks read theirs; a failure on any rank fails the job.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def rank_heads(pool: torch.Tensor, rank: int, heads: int) -> torch.Tensor:
    """Rank `rank`'s heads of L2 pages `[slots, layers, 2, page_size, tp * heads, dim]`:
    a view `[slots, layers, 2, page_size, heads, dim]` over the same memory."""
    total = pool.shape[4]
    if total % heads or not 0 <= rank < total // heads:
        raise ValueError(f"rank {rank} of {heads} heads does not fit pages of {total} heads")
    if total == heads:
        return pool
    return pool.narrow(4, rank * heads, heads)


def tensor_parallel_rank(tp_size: int) -> int:
    """This worker's rank in vLLM's tensor-parallel group (0 at TP 1)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class ReportTally:
    """Worker reports of copy jobs, per job, until all `ranks` ranks reported it."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._seen: dict[int, list[bool]] = {}

    def add(self, reports: Iterable[tuple[int, bool]]) -> list[tuple[int, bool]]:
        """(job, ok) per rank report; returns the jobs every rank has now reported, with
        ok only if it succeeded on every rank."""
        done = []
        for job, ok in reports:
            seen = self._seen.setdefault(job, [])
            seen.append(ok)
            if len(seen) == self.ranks:
                del self._seen[job]
                done.append((job, all(seen)))
        return done
