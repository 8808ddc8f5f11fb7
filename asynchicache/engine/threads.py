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

Small steps run on one thread whatever the count (`for_step`): a step of at
most a page of new tokens (a cache hit's partial last page, the decodes of up
to 16 requests) that reads less KV than weights (`small_step`) reads every
weight once for a few rows, so it is bound by memory, and a second thread buys
little even alone (a 1-token forward over 1,553 cached tokens, SmolLM2: 32 ->
27 ms) while it takes the core the HTTP process and the client need to stream
the tokens out. In the server, measured
interleaved on 2 cores (docs/benchmarks.md, 2026-12-02): the same 1-token
forward took 37-52 ms on two threads and 30-31 ms on one; a warm hit that
computes a 6-15-token tail right after the cold request, median 103 ms with
such steps on two threads and 82 ms on one; 8 clients decoding 64 tokens each,
98-118 completion tokens/s on two threads and 115-126 on one.
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
# Steps of at most this many new tokens run on one thread (module docstring).
SMALL_STEP_TOKENS = 16


def small_step(new_tokens: int, kv_bytes: int, weight_bytes: int) -> bool:
    """A step that runs on one thread (module docstring): few new tokens, and KV reads no
    larger than the weights' (many long decodes read more KV than weights; the attention
    kernel splits those reads across the threads and they scale: 16 decodes of 1,032
    tokens of SmolLM2, 761 MB of KV, 105 ms a step on one thread, 69-78 ms on two)."""
    return new_tokens <= SMALL_STEP_TOKENS and kv_bytes <= weight_bytes


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
        self._applied: int | None = None  # what torch was last set to by us
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
        self._set(self.threads)
        return self.threads

    def for_step(self, new_tokens: int, kv_bytes: int = 0, weight_bytes: int = 0) -> int:
        """Set and return the threads of a step computing `new_tokens` tokens and reading
        `kv_bytes` of KV: one for a small step (`small_step`) unless `--threads` fixed the
        count, else the count."""
        small = self.fixed is None and small_step(new_tokens, kv_bytes, weight_bytes)
        want = 1 if small else self.threads
        if want != self._applied:
            self._set(want)
        return want

    def _set(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self._applied = threads

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
