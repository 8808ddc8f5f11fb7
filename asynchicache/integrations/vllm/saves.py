"""Save planning: which full pages of a request a step copies into L2, and where.

A page is saved only once every token in it is known and accepted and its K/V
is computed by the end of the step being planned. For a request with
`computed` tokens before the step and `scheduled` in it:

    limit = min(computed + scheduled, len(all_token_ids))

* Async scheduling: `all_token_ids` lags the computed count (tokens sampled
  by steps still in flight are not in it). Every token in it was computed by
  an earlier step or by this one, so the known tokens are the limit.
* Speculative decoding: scheduled draft tokens are computed but may be
  rejected, and they are not in `all_token_ids`. A page that holds a draft
  position waits until its tokens are accepted (then they are in
  `all_token_ids`; a rejected position was computed again with the right
  token) and is saved by a later step, from the same blocks.
* Prefill chunks: the chunk's end is the limit.

Pages already in L2, or that the service holds (the request's lookup read and
verified them from it, or was told they exist when L2 had no room to read
them), are not copied again: a page that failed its checks on the way in is
recomputed and saved again. When L2 has no room for a page, planning stops at
it (`saves_deferred`) and the next step tries again from there: the request's
blocks still hold it while it runs. Pages never placed by the time the request
finishes or is preempted are counted as `saves_skipped`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asynchicache.hierarchy.l2.host_index import HostIndex
from asynchicache.integrations.vllm.block_lookup import RequestChain
from asynchicache.integrations.vllm.connector_jobs import Job, JobKind
from asynchicache.integrations.vllm.connector_stats import AsynchicacheStats
from asynchicache.integrations.vllm.metadata import CopyJob
from asynchicache.storage.base import PageRef


def saveable_tokens(computed: int, scheduled: int, known: int) -> int:
    """Tokens whose K/V is right once this step ran: computed and known (see the
    module docstring)."""
    return min(computed + scheduled, known)


@dataclass
class _Progress:
    next_page: int  # pages before it are saved, being saved, held elsewhere or vLLM's own
    held: range = range(0)  # pages the service holds (the request's lookup was told so)
    due: int = 0  # saveable pages so far


class SavePlanner:
    """Per running request, how far its pages are saved; plans the next copies."""

    def __init__(
        self,
        page_size: int,
        pages_per_block: int,
        index: HostIndex,
        stats: AsynchicacheStats,
        register: Callable[[Job], int],
    ) -> None:
        self.page_size = page_size
        self.pages_per_block = pages_per_block
        self.index = index
        self.stats = stats
        self._register = register  # a job -> its id
        self._progress: dict[str, _Progress] = {}

    def start(self, req_id: str, computed_tokens: int) -> None:
        """A request (re)starts with `computed_tokens` vLLM holds already: pages before
        them are not ours to save (its own prefix cache or a load of ours)."""
        held = self._progress.get(req_id)
        self.finish(req_id)
        pages = computed_tokens // self.page_size
        self._progress[req_id] = _Progress(pages, held.held if held else range(0), pages)

    def service_holds(self, req_id: str, pages: range) -> None:
        """The service holds these pages of the request: never store them again."""
        self._progress.setdefault(req_id, _Progress(0)).held = pages

    def plan(
        self,
        req_id: str,
        chain: RequestChain,
        tokens: Sequence[int],
        saveable: int,
        block_ids: Sequence[int],
    ) -> list[CopyJob]:
        """Copy jobs for the pages of the first `saveable` tokens not yet planned."""
        progress = self._progress.get(req_id)
        if progress is None:
            return []
        target = saveable // self.page_size
        progress.due = max(progress.due, target)
        if target <= progress.next_page:
            return []
        hashes = chain.extend(tokens)  # every page up to `target` is known
        missing = [
            p
            for p in range(progress.next_page, target)
            if p not in progress.held and self.index.slot_of(hashes[p]) is None
        ]
        jobs: list[CopyJob] = []
        for run in _runs(missing):
            slots = self.index.allocate(len(run))
            if slots is None:  # L2 is full of pages in use: again next step
                self.stats.add("saves_deferred")
                progress.next_page = run.start
                return jobs
            jobs.append(self._job(req_id, chain, tokens, run, slots, block_ids))
        progress.next_page = target
        return jobs

    def finish(self, req_id: str) -> None:
        """The request is gone (or its blocks are): count what it never saved."""
        progress = self._progress.pop(req_id, None)
        if progress is not None and progress.due > progress.next_page:
            self.stats.add("saves_skipped", progress.due - progress.next_page)

    def _job(
        self,
        req_id: str,
        chain: RequestChain,
        tokens: Sequence[int],
        pages: range,
        slots: list[int],
        block_ids: Sequence[int],
    ) -> CopyJob:
        size, ppb = self.page_size, self.pages_per_block
        refs = [
            PageRef(chain.hashes[p], tuple(tokens[p * size : (p + 1) * size]), s, chain.parent(p))
            for p, s in zip(pages, slots, strict=True)
        ]
        job = self._register(Job(JobKind.SAVE_COPY, req_id, slots, refs))
        first, last = pages[0] // ppb, (pages[-1] // ppb) + 1
        return CopyJob(
            job, req_id, tuple(block_ids[first:last]), tuple(slots), pages[0] - first * ppb
        )


def _runs(pages: list[int]) -> list[range]:
    """Ascending page numbers as runs of consecutive ones."""
    out: list[range] = []
    for p in pages:
        if out and out[-1].stop == p:
            out[-1] = range(out[-1].start, p + 1)
        else:
            out.append(range(p, p + 1))
    return out
