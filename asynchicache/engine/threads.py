"""How many threads the engine's forward pass gets (torch intra-op threads).

On CPU the model's matmuls run on an OpenMP pool that ends each parallel
region at a barrier: if one of its threads is descheduled, every other thread
waits. The HTTP process (detokenizing, streaming), the cache service and a
benchmark's client run on the same cores, and so may anything else on the
machine. (With OpenMP's default spin wait, both cores busy elsewhere made a
batch-8 decode step 1.6-2.7 s on 2 threads instead of 0.23 s on 1; the engine
waits passively since, launch/openmp.py.)

So by default the count for the steps that read the weights (below) follows
what the machine leaves free (`ThreadGovernor`): every core when the other
processes use less than half of one, one core less for each core they keep
busy, and never below one. It reads the other processes' CPU use from
/proc/stat; `--threads N` fixes the count of every step instead. It starts at
every core: a cold prompt right after a quick start-up comes before the first
sample (starting at cores - 1 made the median cold TTFT of `bench compare
--no-vllm` 1.91 s against 1.28 s).

When it samples: a new count takes effect only after two samples in a row ask
for it (a burst of client work does not flip it back and forth), except a rise
seen while idle or as work arrives, taken at once. Under load a sample spans 2 s,
long enough to average the bursty per-step work of the HTTP process. While the
engine is idle it samples every 0.5 s (`start()` at ready: start-up itself is not
measured), again when work arrives, and 0.5 s after a proposal to confirm it.

Which steps it governs (`for_step`): only the steps bound by reading the weights,
those of fewer than 64 new tokens (decodes, a hit's last tokens; at ~350 GFLOPS and
~14 GB/s here a step turns arithmetic-bound near 50 rows). Bigger steps run on every
core whatever the others do. Measured with `python -m asynchicache.bench.micro.contention`
(docs/benchmarks.md, 2026-12-05 13:14 UTC), 2 threads against 1: a 1,024-token prefill
step quiet 1.20 vs 2.27 s, beside 0.3 of a core 1.68 vs 2.41 s, beside one busy core
2.20 vs 2.36 s, one and a half 2.53 vs 2.41 s, both 2.53 vs 2.55 s (at most 5% slower,
up to 1.9x faster: on time-sliced cores two threads get two shares); a batch-8 decode
step quiet 76 vs 101 ms, beside 0.3 of a core 106 vs 103 ms, one core 113 vs 103 ms,
both 124 vs 103 ms (OpenMP's barriers wait for a descheduled thread many times a step).
Under a pressure run the governor used to fall to one thread for seconds while the
benchmark client prepared its requests, and the prompts that came then took 1.5-1.8x
their time; it also cut prompts into short steps while the count might rise. Both
are gone: a long prompt never waits on a sample.

Weight-bound steps run on the governed count, not on one thread: a rule that put
decodes on one thread (to leave the HTTP process and the client a core) gave 8 clients
96-98 tokens/s in the server against 102-103 on the count (104-105 with `--threads 2`),
and was dropped on 2026-12-05.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Other processes using less than this many cores leave the engine every core.
OTHERS_SPARE = 0.5
SAMPLE_EVERY_S = 2.0  # a sample's span while busy with no change proposed
QUICK_SAMPLE_S = 0.5  # while idle, just after work arrived, or to confirm a proposal
# A shorter span when work arrives is mostly the request's own tokenization: wait.
MIN_SAMPLE_S = 0.2
# Steps with this many new tokens or more are bound by arithmetic: every core.
ARITHMETIC_BOUND_TOKENS = 64
PROC_STAT = Path("/proc/stat")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    return len(os.sched_getaffinity(0))


def default_threads(cores: int | None = None) -> int:
    """The engine's starting thread count when `--threads` is not given: every core
    (module docstring)."""
    n = available_cores() if cores is None else cores
    return max(1, n)


def threads_for(cores: int, others: float) -> int:
    """Threads that leave the cores `others` (other processes' CPU use, in cores) needs."""
    return max(1, min(cores, cores - math.ceil(others - OTHERS_SPARE)))


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds spent so far: by every process of the machine, and by this one."""

    at: float  # time.monotonic()
    busy_s: float  # all cores, from /proc/stat
    own_s: float  # this process, every thread


def cpu_sample() -> CpuSample | None:
    """Now's sample, or None where /proc/stat cannot be read (not Linux)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    # guest time is counted in user already (fields 9-10 of the line are not added)
    busy = sum(ticks[:8]) - idle
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuSample(time.monotonic(), busy / hz, own.user + own.system)


def others_cores(before: CpuSample, after: CpuSample, cores_on_machine: int) -> float:
    """Cores other processes kept busy between two samples (ours subtracted)."""
    wall = after.at - before.at
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, min(float(cores_on_machine), others / wall))


class ThreadGovernor:
    """Torch's threads per step (module docstring): `for_step` before each forward;
    `threads`, the count of weight-bound steps, follows the cores other processes leave.

    `poll(idle)` is cheap (a clock read) between samples; call it once per
    engine step or idle turn. `sampler` and `clock` are there for tests.
    """

    def __init__(
        self,
        fixed: int | None = None,
        cores: int | None = None,
        sample_every_s: float = SAMPLE_EVERY_S,
        quick_every_s: float = QUICK_SAMPLE_S,
        sampler: Callable[[], CpuSample | None] = cpu_sample,
        clock: Callable[[], float] = time.monotonic,
        machine_cores: int | None = None,
    ) -> None:
        self.cores = available_cores() if cores is None else cores
        self.fixed = fixed
        self.sample_every_s = sample_every_s
        self.quick_every_s = quick_every_s
        self.threads = fixed if fixed is not None else default_threads(self.cores)
        self._sampler = sampler
        self._clock = clock
        self._machine_cores = machine_cores or os.cpu_count() or self.cores
        self._last: CpuSample | None = None
        self._last_idle = True  # the last sample saw no work (taken idle or as work arrived)
        self._idle = True
        self._proposal: int | None = None
        self.changes = 0
        self._applied: int | None = None
        self.start()

    @property
    def settling(self) -> bool:
        """A new count is proposed and waits for a second sample to agree."""
        return self._proposal is not None

    def apply(self, threads: int | None = None) -> int:
        """Set torch's thread count (the governed count by default); returns it."""
        n = self.threads if threads is None else threads
        if n != self._applied:
            torch.set_num_threads(n)
            self._applied = n
        return n

    def for_step(self, new_tokens: int) -> int:
        """Set and return the threads of a step computing `new_tokens` (before its
        forward): the governed count for weight-bound steps, every core for the others
        unless the count is fixed (module docstring)."""
        if self.fixed is None and new_tokens >= ARITHMETIC_BOUND_TOKENS:
            return self.apply(self.cores)
        return self.apply()

    def start(self) -> None:
        """Measure from now on (call when the engine is ready: model loading is not load)."""
        self._last = self._sampler() if self.fixed is None else None
        self._proposal = None

    def poll(self, idle: bool = False) -> int | None:
        """The new governed count when it changed, else None (`for_step` applies it).

        `idle`: the engine has no work now."""
        arrived = self._idle and not idle
        self._idle = idle
        if self._last is None:
            return None
        since = self._clock() - self._last.at
        if since < self._due_after(arrived):
            return None
        now = self._sampler()
        if now is None:
            self._last = None
            return None
        others = others_cores(self._last, now, self._machine_cores)
        self._last, self._last_idle = now, idle or arrived
        return self._propose(threads_for(self.cores, others))

    def _due_after(self, arrived: bool) -> float:
        if arrived:
            return MIN_SAMPLE_S  # what the machine did until the request came
        if self._idle or self._last_idle or self.settling:
            return self.quick_every_s
        return self.sample_every_s

    def _propose(self, threads: int) -> int | None:
        if threads == self.threads:
            self._proposal = None
            return None
        # A rise seen idle or as work arrives is taken at once (module docstring); any
        # other change waits for a second sample to agree.
        rise_now = threads > self.threads and self._last_idle
        if self._proposal != threads and not rise_now:
            self._proposal = threads
            return None
        self._proposal = None
        self.threads = threads
        self.changes += 1
        return threads
