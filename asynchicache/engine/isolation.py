"""A request that fails inside a step fails alone; the engine and the others go on.

The edge validates every field and the sampler is total over what passes
(engine/sampling/sampler.py), so nothing here should ever run. If something still raises
in a step (a sampler bug, a value no test thought of, a kernel error), the
engine must not die with it: that would end every client's stream.

* Sampling: the batch is picked at once; if that raises, each row is picked
  alone and only the rows that still raise fail.
* The forward pass: if it raises, each sequence runs alone; those that still
  raise fail, the others run again together (`without_culprits`). A
  failure that comes back for every sequence alone cannot be pinned on one.
* Anything else in a step (prompt logprobs, forking a group), and a forward no
  sequence can be blamed for, fails every request of that step (with the
  members of their groups), the step's pages are released as for any finished
  request, and the next step runs as usual.

A failed request finishes with reason "error" and a message that names the
exception type only: an exception's text may quote token ids or sizes of
another tenant's prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from asynchicache.engine.request import Request
from asynchicache.engine.sampling.sampler import Pick, pick
from asynchicache.engine.scheduling.batch import Batch, ScheduledSeq
from asynchicache.engine.scheduling.scheduler import Scheduler
from asynchicache.model.runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)


def failure_message(what: str, exc: BaseException) -> str:
    """What the client reads: the stage and the exception's type, no data."""
    return f"the engine failed while {what} ({type(exc).__name__}); this request was ended"


def pick_isolated(logits: torch.Tensor, ready: Sequence[Request]) -> list[Pick | BaseException]:
    """logits [len(ready), vocab] -> a pick per request, or the exception its row raised."""
    params = [r.sampling for r in ready]
    generators = [r.generator for r in ready]
    histories = [(r.prompt, r.output) for r in ready]
    try:
        return list(pick(logits, params, generators, histories))
    except Exception:
        log.exception("sampling a batch of %d failed; sampling its rows one by one", len(ready))
    out: list[Pick | BaseException] = []
    for i in range(len(ready)):
        try:
            out.append(pick(logits[i : i + 1], params[i : i + 1], generators[i : i + 1],
                            histories[i : i + 1])[0])  # fmt: skip
        except Exception as exc:
            log.error("sampling request %s failed alone: %r", ready[i].rid, exc)
            out.append(exc)
    return out


def fail_requests(scheduler: Scheduler, rids: Iterable[str], message: str) -> int:
    """End every scheduled request of these rids (a group's members share one) with an
    error; returns how many. Members still waiting for their leader's prefill end with
    it when the engine drains the finished leader."""
    wanted = set(rids)
    found = [
        r
        for r in [
            *scheduler.waiting,
            *scheduler.landing,
            *scheduler.running,
            *scheduler.loading.values(),
        ]
        if r.rid in wanted
    ]
    for req in found:
        scheduler.finish(req, "error", message)
    return len(found)


def forward_input(batch: Batch) -> ForwardBatch:
    """The model's input for a scheduled batch: each sequence's new tokens from where its
    computed part ends."""
    every = [s.request.needs_whole_prompt for s in batch.seqs]
    return ForwardBatch(
        token_ids=[
            s.request.tokens[s.request.num_computed : s.request.num_computed + s.num_new]
            for s in batch.seqs
        ],
        starts=[s.request.num_computed for s in batch.seqs],
        page_tables=[s.request.page_table for s in batch.seqs],
        every_position=every if any(every) else (),
    )


def without_culprits(
    runner: ModelRunner, scheduler: Scheduler, batch: Batch, exc: Exception
) -> tuple[Batch, int]:
    """Each sequence of a failed forward runs alone; those that fail end with an error,
    the others are returned to run again together (a forward is idempotent: it writes
    the same KV to the same slots), with how many requests failed. Raises `exc` when no
    sequence can be told apart (every one of several fails alone): then the step fails as
    a whole."""
    culprits = {s.request.rid for s in batch.seqs if _fails_alone(runner, s)}
    if len(batch.seqs) > 1 and len(culprits) == len({s.request.rid for s in batch.seqs}):
        raise exc
    message = failure_message("computing a step", exc)
    failed = fail_requests(scheduler, culprits, message)
    return Batch([s for s in batch.seqs if s.request.rid not in culprits]), failed


def _fails_alone(runner: ModelRunner, seq: ScheduledSeq) -> bool:
    try:
        runner.forward(forward_input(Batch([seq])))
    except Exception as exc:
        log.error("request %s fails the forward alone: %r", seq.request.rid, exc)
        return True
    return False
