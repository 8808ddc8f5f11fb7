"""Which prompts a step computes: the ones nearest their first token first.

Under memory pressure most requests are hits whose prompt is a few dozen
tokens past a cached prefix, and some are misses of a thousand tokens. The
batch used to take prompts oldest first, up to `--chunked-prefill-size` each
and `--max-prefill-tokens` in all: four misses then shared every step
(2,048 tokens, 2 s on two cores here), so each finished only when all four
did, and a hit that arrived meanwhile waited behind a whole such step and
then shared the next one. A step that carries first tokens was stretched by
other requests' long prompts.

So, after the decodes (one token each, first as before):

* prompts go shortest remaining first (oldest first among equals): a hit's
  few tokens are never queued behind a miss's chunk, and among misses the one
  furthest along finishes first instead of all sharing;
* a step computes at most one prompt it does not finish (`partial_allowed`):
  every prompt that completes in the step (first tokens) and one chunk of the
  next prompt in line, so a step holds one chunk of uncached work plus what is
  about to answer, and the misses take turns rather than share;
* with only long misses in hand and nothing queued or loading (`chunk_tokens`),
  a prompt's chunk is the whole step budget (`--max-prefill-tokens`): no first
  token waits behind the longer step, and it computes faster (a 1,032-token
  prompt, 2 threads: 1,246 tok/s in 512-token chunks, 1,385 whole). Medians of
  3 one-arm pressure runs (docs/benchmarks.md, 2026-12-04): 16 clients 2.87 ->
  2.92 req/s, TTFT p90 4.39 -> 2.97 s; 4 clients 2.32 -> 2.49 req/s, p90 1.36
  -> 1.55 s (hits wait behind the longer steps), p99 3.58 -> 3.20 s.

`StepBudget`: a step is bounded by time (`--max-step-ms`), not only by tokens.
A request that arrives while a step runs waits for that step to end (a step
cannot be cut short), and a hit's first token then comes in the next step: the
longest step bounds how long a cached prompt waits for a miss's. So a step's
prompt tokens are what the measured prefill pace (`CostModel.prefill_tok_s`, an
average of tokens per second of the steps that computed prompts) computes in the
target time, less one for each decode riding in it, at most
`--max-prefill-tokens` and at least `MIN_STEP_TOKENS` (small steps are bound by
reading the weights: their pace is not the prompts', engine/threads.py). The
prompts that finish in the step go first (shortest first, above) and the one
unfinished prompt (a miss's chunk) fills what is left; the oldest prompt, left
out when the prompts ahead of it took the budget, still gets
`STARVE_FLOOR_TOKENS`: a stream of hits cannot starve a miss. The pace is
measured on such steps, so the budget settles where a step takes the target.
But a step is never so short that its fixed cost (`CostModel.step_fixed_s`: a
decodes-only forward, or the intercept of a line fitted through recent prompt
steps, the larger; reading the weights, ~35 ms here; seconds when other
processes keep the cores busy and OpenMP's barriers wait for descheduled
threads, which a decodes-only step on fewer threads does not show) is more than a
quarter of it: on a busy machine a 250 ms target gave steps of 64 tokens that
spent most of their time in that fixed cost (a 4-client pressure run at load
~15: 35 tokens per forward-second against 55 without the bound, 0.11 against
0.18 req/s). Where the target cannot be met cheaply, throughput wins.

`QuickLoads`: a load served from L2 alone is a memory copy of a few
milliseconds (a 1,000-token prefix, 45 MB, at ~10 GB/s), but the scheduler
used to collect it at the next step, a whole step (up to seconds) later. The
scheduler waits for such loads, started in this step, for at most a bounded
time (twice the copy's expected time, at most `QUICK_LOAD_MAX_WAIT_S`) so the
request joins the step it was admitted in; loads with a storage part (disk,
Redis) are never waited for. On CPU the copy is made by the scheduler's own
thread as the load starts (hierarchy/l2/transfer.py: a copy thread on busy
cores missed that bound for half the L2 hits of a 16-client pressure run), so
the first poll collects it; the bounded wait is for CUDA's side stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from asynchicache.engine.request import Phase, Request

QUICK_LOAD_MAX_WAIT_S = 0.02  # a copy slower than this is not worth holding a step for
POLL_S = 0.0005
# A time-bounded step computes at least this many prompt tokens (when it has them): the
# engine measures the prefill pace on steps of 64 prompt tokens or more (engine.py).
MIN_STEP_TOKENS = 64
STARVE_FLOOR_TOKENS = 32  # of the unfinished prompt, even when the hits took the budget
# A step is long enough that its fixed cost is at most 1/4 of it (module docstring).
OVERHEAD_SHARES = 4


def batch_order(req: Request) -> tuple[bool, int, float]:
    """Sort key of the running requests for a step: decodes, then the shortest prompts."""
    return (req.is_prefill, req.remaining if req.is_prefill else 0, req.arrival)


def chunk_tokens(chunk: int, budget: int, prompts: Iterable[Request], queued: bool) -> int:
    """Tokens of one prompt a step may compute: `chunk` (--chunked-prefill-size), or the
    whole step's `budget` when every prompt in hand is a long miss and nothing else is
    queued or loading (`queued`): no hit's first token waits behind the longer step, and
    a longer step computes a prompt faster (one 1,032-token prompt, SmolLM2, 2 threads:
    1,246 tok/s in 512-token chunks, 1,385 whole; bench/micro/step_shapes.py)."""
    if queued or any(r.remaining <= chunk for r in prompts):
        return chunk
    return max(chunk, budget)


@dataclass(frozen=True)
class StepBudget:
    """Prompt tokens of a step under `--max-step-ms` (module docstring)."""

    max_step_s: float  # 0: no time bound
    cap: int  # --max-prefill-tokens

    def prompt_tokens(self, tok_s: float, decodes: int, fixed_s: float = 0.0) -> int:
        """Prompt tokens a step beside `decodes` decodes may compute at `tok_s` tokens/s;
        `fixed_s`: what a step costs whatever its prompt tokens (a decodes-only step)."""
        if self.max_step_s <= 0:
            return self.cap
        fits = int(self.max_step_s * tok_s) - decodes
        # Never so few that the fixed cost is more than 1/OVERHEAD_SHARES of the step.
        efficient = int(OVERHEAD_SHARES * fixed_s * tok_s)
        return min(self.cap, max(MIN_STEP_TOKENS, fits, efficient))

    def floor_tokens(self, most: int, spent: int) -> int:
        """Tokens the oldest prompt gets in a step that left it out (the hits ahead of it
        took the budget): `STARVE_FLOOR_TOKENS`, at most `most` and what the cap leaves
        (`spent`: the step's prompt tokens so far); none without a time bound."""
        if self.max_step_s <= 0:
            return 0
        return max(0, min(most, STARVE_FLOOR_TOKENS, self.cap - spent))


def partial_allowed(partials: int) -> bool:
    """Whether one more prompt that does not finish in this step may join it."""
    return partials == 0


class QuickLoads:
    """Waits (bounded) for L2-only loads started in this step (module docstring)."""

    def __init__(
        self, copy_seconds: Callable[[int], float], max_wait_s: float = QUICK_LOAD_MAX_WAIT_S
    ) -> None:
        self._copy_seconds = copy_seconds  # expected seconds of an L2 -> L1 copy of n pages
        self._max_wait_s = max_wait_s
        # This step's requests whose load landed while waited for, and the seconds waited
        # (the engine's trace counts them as load time: engine/trace.py).
        self.landed: list[tuple[Request, float]] = []

    def wait(self, started: Iterable[Request], poll: Callable[[], None]) -> None:
        """Poll until every load of `started` that reads only L2 landed, or time is up."""
        self.landed = []
        quick = [r for r in started if _host_only(r)]
        if not quick:
            return
        budget = self.budget_s(quick)
        began = time.monotonic()
        while any(r.phase is Phase.LOADING for r in quick) and time.monotonic() - began < budget:
            poll()  # first at once: on CPU the copy was made as the load started (transfer.py)
            if any(r.phase is Phase.LOADING for r in quick):
                time.sleep(POLL_S)
        waited = time.monotonic() - began
        self.landed = [(r, waited) for r in quick if r.phase is not Phase.LOADING]

    def budget_s(self, quick: list[Request]) -> float:
        """Seconds a step waits for `quick`'s copies: twice their expected time, bounded."""
        pages = sum(r.load_ticket.pages_from_host for r in quick if r.load_ticket is not None)
        return min(self._max_wait_s, 2 * self._copy_seconds(pages))


def _host_only(req: Request) -> bool:
    ticket = req.load_ticket
    return (
        req.phase is Phase.LOADING
        and ticket is not None
        and ticket.pages_from_storage == 0
        and ticket.pages_from_host > 0
    )
