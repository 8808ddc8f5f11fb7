"""Start-up's warm-up: the model run on a short prompt, on one token and on the short prompt
again, then on prompts growing toward one of the largest step, and every L1 page written
once: as much of that as fits a time budget (the host decides how much, not a fixed amount).

oneDNN builds a kernel for each new matrix shape on first use (~0.5 ms a linear layer
here): without this, the first request after a start, often a whole-prompt cache hit that
computes one token, pays for them. The long prompt (`--max-prefill-tokens`, within the
context and L1) grows the heap to a step's activations, and on CPU every L1 page is
written once before it: the first long prompt after a start paid for both (one process,
SmolLM2, a 1,546-token forward after the short warm-up alone 1.58-1.62 s, after these
1.46-1.49 s, later ones 1.44-1.50 s). vLLM's start-up also runs a forward of its step
budget (its memory profiling). The KV goes to private pages freed again; nothing reaches
the cache.

Bounded by time: a forward of the largest step took ~1 s on an AVX-512 host and over 10 on
an AVX2 one, so a fixed amount of work made start-up as slow as the host. Each prompt is
`WARM_UP_GROWTH` times the last, run only when the last one's time scaled by that factor
fits what is left of the budget (per token, a short prompt costs more than a long one: the
guess errs toward stopping early); the pages are written in slices, half the budget for
them before the long prompts and the rest of it after.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asynchicache.engine.scheduling.cost import CostModel
from asynchicache.engine.scheduling.prefill_policy import MIN_STEP_TOKENS
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.model.runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)

# Seconds the warm-up may take (the whole warm-up took ~2 s on the AVX-512 host, and the
# rest of a start ~5 s of the 10 s a start may take), how much longer each warm-up prompt
# is than the last, and the L1 pool written per slice.
WARM_UP_BUDGET_S = 4.0
WARM_UP_GROWTH = 8
PREFAULT_SLICE_BYTES = 64 << 20


@dataclass(frozen=True)
class WarmUp:
    """What `warm_up` did within its budget."""

    tokens: int  # the longest prompt it ran
    wanted_tokens: int  # the largest step (what it would run with time enough)
    pages_written: int  # L1 pages written once (all of them, or where time ran out)
    seconds: float


def warm_up(
    cache: HiRadixCache, runner: ModelRunner, cost: CostModel, longest: int, budget_s: float
) -> WarmUp:
    """Warm the model up to prompts of `longest` tokens and write L1 once, within
    `budget_s` seconds (the module doc); returns what it did."""
    start = time.monotonic()
    deadline = start + budget_s
    ps = cache.page_size
    short = max(1, ps - 1)
    # The short prompt again: its second run has no first-use costs, so its time
    # predicts the longer prompts' (the first one's overstated them several times).
    seconds = _warm_forward(cache, runner, cost, [short, 1, short])[-1]
    prefaulted = _prefault_device_pool(cache, 0, start + budget_s / 2)
    n, warmed = short, short
    while n < longest:
        n = min(longest, n * WARM_UP_GROWTH)
        if n <= ps or time.monotonic() + seconds * n / warmed > deadline:
            break
        seconds, warmed = _warm_forward(cache, runner, cost, [n])[0], n
    prefaulted = _prefault_device_pool(cache, prefaulted, deadline)
    done = WarmUp(warmed, longest, prefaulted, round(time.monotonic() - start, 3))
    log.info("warm-up: %s", done)
    return done


def _warm_forward(
    cache: HiRadixCache, runner: ModelRunner, cost: CostModel, steps: list[int]
) -> list[float]:
    """Forwards of `steps[i]` tokens each, one after another, into private pages;
    the seconds of each (none where the pages were not there)."""
    pages = cache.allocate(-(-sum(steps) // cache.page_size))
    if pages is None:
        return [0.0] * len(steps)
    seconds = []
    try:
        done = 0
        for n in steps:
            began = time.monotonic()
            runner.forward(ForwardBatch([[0] * n], [done], [pages]))
            took = time.monotonic() - began
            seconds.append(took)
            if n >= MIN_STEP_TOKENS:  # the pace steps are sized from (prefill_policy.py)
                cost.prefill_tok_s.seed(n, took)
            done += n
    finally:
        cache.free(pages)
    return seconds


def _prefault_device_pool(cache: HiRadixCache, begin: int, deadline: float) -> int:
    """On CPU, write L1 pages [begin, ...) once while none is used, a slice at a time
    until the deadline: the pool is mapped lazily (`torch.zeros`), so each page would
    fault in on a request's first write. Returns the pages written from 0."""
    pool = cache.device_pool.tensor
    total = pool.shape[0]
    occupancy = cache.stats().device
    if pool.device.type != "cpu" or occupancy.free != occupancy.total:
        return total
    per_slice = max(1, PREFAULT_SLICE_BYTES // max(1, pool[0].numel() * pool.element_size()))
    while begin < total and time.monotonic() < deadline:
        end = min(total, begin + per_slice)
        pool[begin:end].zero_()
        begin = end
    return begin
