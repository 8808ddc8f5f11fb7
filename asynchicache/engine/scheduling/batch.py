"""A step's batch (what the scheduler hands the engine to compute) and what is left of the
step while the scheduler builds it (engine/scheduling/scheduler.py's `_batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asynchicache.engine.request import Phase, Request
from asynchicache.engine.scheduling.prefill_policy import partial_allowed


@dataclass
class ScheduledSeq:
    request: Request
    num_new: int  # tokens fed this step: request.tokens[num_computed : num_computed + num_new]


@dataclass
class Batch:
    seqs: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    def __contains__(self, req: object) -> bool:
        return any(s.request is req for s in self.seqs)


@dataclass
class StepFill:
    """What is left of a step while its batch is built."""

    budget: int  # prompt tokens
    chunk: int  # of one prompt
    spent: int = 0  # prompt tokens taken
    partials: int = 0  # prompts taken that do not finish in the step
    starts: set[tuple[object, ...]] = field(default_factory=set)  # fresh prompts' next pages

    def tokens_for(self, req: Request, fresh_page: tuple[object, ...] | None) -> int:
        """New tokens of `req` in this step (0: none); `fresh_page`: its next full page
        when it is a fresh prompt (engine/scheduling/prefix_join.py)."""
        if req.phase is not Phase.RUNNING:
            return 0  # preempted while building this batch
        if not req.is_prefill:
            return 1
        if fresh_page in self.starts:
            return 0  # another prompt of the step computes it: join its pages next step
        n = min(req.remaining, self.chunk, self.budget)
        if n < req.remaining and not partial_allowed(self.partials):
            return 0
        return n
