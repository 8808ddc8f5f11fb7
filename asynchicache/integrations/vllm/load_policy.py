"""When the connector loads a hit, and when a request waits for its lookup.

The rule is our engine's (hierarchy/load_cost.py's `LoadCost`): load a prefix only
when loading it beats recomputing it. The rates are this host's and this
vLLM's, measured:

    host     L2 -> vLLM's blocks, bytes/s: timed at start on pages of our L2
             segment (the worker's copy is a gather of the same bytes)
    disk     the service's reads into L2 (L3, and L4 `remote`), bytes/s: each
    remote   read's pages over its time, from the engine's starting guesses
    prefill  vLLM's scheduled tokens / the execution time of steps with at
             least 64 prompt tokens (`StepClock`), as our engine measures its own
    step     seconds of a step: what a request that waits for a lookup loses

and three decisions use them, each for what is left to pay at that moment:

* read: pages the service holds are read into L2 only if reading and copying
  them beats recomputing them (a hit that does not pay is `skipped_unprofitable`);
* wait: at the scheduler's visit, a lookup not answered yet is waited for (the
  request skips the step) only if what it may still bring saves more than a
  step; otherwise the request goes at once with what L2 holds
  (`lookups_not_waited`);
* load: a hit verified in L2 is loaded only if copying it beats recomputing
  it, a step's delay added when loads are asynchronous (`load_async`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.load_cost import LoadCost, Rate
from asynchicache.integrations.vllm.connector_config import ConnectorConfig

HOST, DISK, REMOTE = Tier.HOST.value, Tier.DISK.value, Tier.REMOTE.value
# Starting guesses until measured: the engine's (engine/scheduling/cost.py) for reads, a CPU
# vLLM's prefill of a small model on two threads, a step of a busy CPU server.
_START_PREFILL_TOK_S = 1000.0
_START_DISK_BPS = 3e8
_START_REMOTE_BPS = 1e8
_START_STEP_S = 0.1
MIN_PREFILL_TOKENS = 64  # a step with fewer prompt tokens measures its overhead, not prefill
_TIMED_PAGES = 64  # pages copied at start to time L2
_MAX_TIMED_JOBS = 4096


def copy_rate(pool: torch.Tensor, pages: int = _TIMED_PAGES) -> float:
    """Bytes/s of copying `pages` pages out of the L2 pool, the best of three."""
    src = pool[: max(1, min(pages, pool.shape[0]))]
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / max(best, 1e-9)


@dataclass
class LoadPolicy:
    """The connector's rates and the decisions taken from them (module docstring)."""

    cost: LoadCost
    step_s: Rate = field(default_factory=lambda: Rate(_START_STEP_S))
    load_async: bool = False
    always: bool = False  # load_policy "always": every hit of min_load_tokens pays

    @classmethod
    def measured(cls, pool: torch.Tensor, config: ConnectorConfig) -> LoadPolicy:
        page_bytes = pool[0].numel() * pool.element_size()
        bandwidth = {
            HOST: Rate(copy_rate(pool)),
            DISK: Rate(_START_DISK_BPS),
            REMOTE: Rate(_START_REMOTE_BPS),
        }
        cost = LoadCost(
            page_bytes,
            config.page_size,
            config.min_load_tokens,
            Rate(_START_PREFILL_TOK_S),
            bandwidth,
        )
        return cls(cost, load_async=config.load_async, always=config.load_policy == "always")

    def _extra(self, tier: str, wait: bool) -> tuple[float, float]:
        """(fixed seconds, seconds per page) a load from `tier` costs beyond its bytes:
        a step when loads are asynchronous (the request is computed a step later) or
        when the request waits for the lookup, and the copy out of L2 for pages read
        into it first."""
        fixed = self.step_s.value if self.load_async else 0.0
        if wait:
            fixed += self.step_s.value
        per_page = 0.0 if tier == HOST else self.cost.load_seconds({HOST: 1})
        return fixed, per_page

    def pays(self, pages: int, tier: str = HOST, wait: bool = False) -> bool:
        """Whether `pages` from `tier` (HOST: verified in L2, to copy; DISK, REMOTE: to
        read into L2 first) are worth loading, and with `wait`, worth a step's wait."""
        if self.always:
            return pages > 0 and pages * self.cost.page_size >= self.cost.min_load_tokens
        fixed, per_page = self._extra(tier, wait)
        return self.cost.pays({tier: pages}, fixed + per_page * pages)

    def break_even_tokens(self, tier: str = HOST, wait: bool = False) -> int | None:
        """The shortest hit from `tier` that `pays` (None: none does)."""
        if self.always:
            return max(self.cost.min_load_tokens, self.cost.page_size)
        pages = self.cost.break_even_pages(tier, *self._extra(tier, wait))
        return None if pages is None else pages * self.cost.page_size

    def observe_read(self, disk_pages: int, remote_pages: int, seconds: float) -> None:
        self.cost.observe_load({DISK: disk_pages, REMOTE: remote_pages}, seconds)

    def describe(self) -> dict[str, str | float | int | None]:
        """The rates and break-evens now (logged, and read by tests and benches)."""
        c = self.cost
        return {
            "policy": "always" if self.always else "cost",
            "prefill_tok_s": round(c.prefill_tok_s.value, 1),
            "step_s": round(self.step_s.value, 4),
            **{f"{t}_MBps": round(r.value / 1e6, 1) for t, r in c.bandwidth.items()},
            "break_even_tokens_host": self.break_even_tokens(HOST),
            "break_even_tokens_disk": self.break_even_tokens(DISK),
            "break_even_tokens_wait_disk": self.break_even_tokens(DISK, wait=True),
        }


@dataclass
class _Step:
    scheduled_at: float
    tokens: int
    prefill_tokens: int


class StepClock:
    """Times vLLM's steps from the scheduler side: a step is scheduled when its
    metadata is built and done when the worker reports one of its copy jobs, which
    vLLM hands over right after the step ran. Steps without copy jobs go untimed
    (mostly decode steps, which say little about prefill)."""

    def __init__(self, policy: LoadPolicy) -> None:
        self.policy = policy
        self._by_job: dict[int, _Step] = {}

    def scheduled(self, jobs: Iterable[int], num_scheduled: Mapping[str, int]) -> None:
        jobs = list(jobs)
        if not jobs:
            return
        if len(self._by_job) > _MAX_TIMED_JOBS:  # reports that never came (a dead worker)
            self._by_job.clear()
        prefill = sum(n for n in num_scheduled.values() if n > 1)
        step = _Step(time.monotonic(), sum(num_scheduled.values()), prefill)
        for job in jobs:
            self._by_job[job] = step

    def reported(self, jobs: Iterable[int]) -> None:
        now = time.monotonic()
        steps = {id(s): s for s in (self._by_job.pop(j, None) for j in jobs) if s is not None}
        for step in steps.values():
            self._observe(step, now - step.scheduled_at)

    def forget(self, jobs: Iterable[int]) -> None:
        for job in jobs:
            self._by_job.pop(job, None)

    def _observe(self, step: _Step, seconds: float) -> None:
        if step.tokens <= 0 or seconds <= 0:
            return
        self.policy.step_s.observe(seconds, 1.0)
        if step.prefill_tokens >= MIN_PREFILL_TOKENS:
            self.policy.cost.prefill_tok_s.observe(step.tokens, seconds)
