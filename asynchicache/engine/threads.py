"""How many threads the engine's forward pass gets (torch intra-op threads).

On CPU the model's matmuls run on an OpenMP pool that ends each parallel
region at a barrier: if one of its threads is descheduled, every other thread
waits. The HTTP process (detokenizing, streaming), the cache service and a
benchmark's client run on the same cores, and so may anything else on the
machine. Measured here (one process, best of 3, other processes' load ~3.7 on
2 cores): 2 threads made a batch-8 decode step 70 -> 53 ms and a 256-token
prefill 615 -> 340 ms, but with both cores busy elsewhere a batch-8 step took
1.6-2.7 s instead of 0.23 s with 1 thread.

So by default the thread count follows what the machine leaves free
(`ThreadGovernor`): every core when the other processes use less than half
of one, one core less for each core they keep busy, and never below one.
(It was a quarter: then the HTTP process, the cache service and a benchmark
client streaming under pressure, ~0.3 of a core together, left the engine one
thread on two cores while vLLM computed on both. A thread descheduled a third
of the time still leaves a big step ~1.4x one thread's pace; the barrier
stalls measured above were with the other core busy all the time; not yet
measured on a quiet machine.) It reads the other processes' CPU use from
/proc/stat; `--threads N` fixes the count instead.

It starts at every core. It started at cores - 1 (as vLLM's CPU backend keeps a
core for its frontend), but when start-up is quick a cold prompt arrives before
the first sample has raised the count: a 1,557-token prompt right after
start-up then ran in 256-550-token steps on one thread, 1.77-1.80 s, against
1.22-1.31 s as one step on two; over `bench compare --no-vllm --clients 8
--rounds 3` (docs/benchmarks.md, 2026-12-05, quiet machine) the median cold
TTFT went 1.91 -> 1.28 s and 8 clients' tokens/s 158 -> 171. A thread more
than the machine leaves costs little with passive waits (below), and the
governor lowers the count within a sample and its confirmation when other
processes keep a core busy.

When it samples: a new count takes effect only after two samples in a row ask
for it (a burst of client work does not flip it back and forth), except a rise
seen while idle or as work arrives, taken at once: more threads than the machine
leaves cost little with passive waits (below), and a request that comes right
after a busy spell is otherwise cut into short steps for a second.
Under load a sample spans 2 s, long enough to average the bursty per-step work
of the HTTP process. While the engine is idle a switch costs nothing, so it
samples every 0.5 s: the engine meets its first request with what the machine
leaves once start-up has settled (`start()` at ready: start-up itself is not
measured). It samples again when work arrives, 0.5 s into the work, and 0.5 s
after a proposal to confirm it. The count can only change between steps, so
until it has sampled the work (and while a rise is proposed) the engine keeps
its prefill steps short (`prefill_cap`): a long prompt that comes just after the
machine went idle is not computed on one thread throughout. Only while the count
may rise: where it may only fall (at every core, or a fall proposed), steps stay
whole, since with OpenMP's passive wait (engine/openmp.py) two threads beside a
process busy 30% of a core were no slower than one (docs/benchmarks.md,
2026-12-03), while 256-token steps made a cold 1,557-token prompt's TTFT in the
server 1.22-1.43 s (`--threads 2`, whole) -> 1.47-1.62 s. (The HTTP process and
the client preparing a request right after another often propose a fall.)

Every step runs on the count, small ones too. Steps of at most 16 new tokens that
read less KV than weights (decodes, a hit's partial last page) used to run on one
thread, to leave the HTTP process and the client a core to stream the tokens out
(measured 2026-12-02 on another host: 8 decoding clients 115-126 tokens/s on one
thread, 98-118 on two). With the engine's allocator settings (engine/allocator.py:
freed blocks kept, weights on huge pages) a batch-8 decode step of SmolLM2 is 72 ms
on one thread and 60 ms on two in one process, and in the server (`bench compare
--no-vllm --clients 8 --rounds 2`, twice each, 2026-12-05) 8 clients got 96-98
tokens/s with the rule and 102-103 without it (104-105 with `--threads 2`); the
governor still gives a core up when other processes keep one busy. A warm hit no
longer waits for its tail's forward (engine/prompt_logits.py).
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
# Prefill tokens per step while unsure (`prefill_cap`): ~0.75 s at one thread on the
# default model here (339 tok/s), so the next sample comes within a long prompt.
UNSURE_PREFILL_TOKENS = 256
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
    """Adjusts torch's threads to the cores other processes leave (module docstring).

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
        self.start()

    @property
    def settling(self) -> bool:
        """A new count is proposed and waits for a second sample to agree."""
        return self._proposal is not None

    @property
    def prefill_cap(self) -> int | None:
        """Prefill tokens per step the engine should keep to now (None: no limit): while
        the count may rise, i.e. a rise waits for confirmation, or no sample has seen the
        engine busy yet and the count is below every core (module docstring)."""
        rising = self._proposal is not None and self._proposal > self.threads
        unsure = rising or (self._last_idle and self.threads < self.cores)
        return UNSURE_PREFILL_TOKENS if unsure and self._last is not None else None

    def apply(self) -> int:
        """Set torch's thread count to the governed count (between steps); returns it."""
        torch.set_num_threads(self.threads)
        return self.threads

    def start(self) -> None:
        """Measure from now on (call when the engine is ready: model loading is not load)."""
        self._last = self._sampler() if self.fixed is None else None
        self._proposal = None

    def poll(self, idle: bool = False) -> int | None:
        """The new thread count when it changed (already applied), else None.

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
        return self.apply()
