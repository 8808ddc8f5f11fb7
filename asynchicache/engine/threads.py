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
(`ThreadGovernor`): every core when the other processes use less than a
quarter of one, one core less for each core they keep busy, and never below
one. It starts at cores - 1 (vLLM's CPU backend likewise keeps a core for its
frontend) and reads the other processes' CPU use from /proc/stat every couple
of seconds. `--threads N` fixes the count instead.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Other processes using less than this many cores leave the engine every core.
OTHERS_SPARE = 0.25
SAMPLE_EVERY_S = 2.0
PROC_STAT = Path("/proc/stat")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    return len(os.sched_getaffinity(0))


def default_threads(cores: int | None = None) -> int:
    """The engine's starting thread count when `--threads` is not given: cores - 1, at least 1."""
    n = available_cores() if cores is None else cores
    return max(1, n - 1)


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

    `poll()` is cheap (a clock read) between samples; call it once per engine
    step or idle turn. A new count takes effect after two samples agree, so a
    burst of client work does not flip it back and forth.
    """

    def __init__(
        self,
        fixed: int | None = None,
        cores: int | None = None,
        sample_every_s: float = SAMPLE_EVERY_S,
    ) -> None:
        self.cores = available_cores() if cores is None else cores
        self.fixed = fixed
        self.sample_every_s = sample_every_s
        self.threads = fixed if fixed is not None else default_threads(self.cores)
        self._machine_cores = os.cpu_count() or self.cores
        self._last = cpu_sample() if fixed is None else None
        self._proposal: int | None = None
        self.changes = 0

    def apply(self) -> int:
        torch.set_num_threads(self.threads)
        return self.threads

    def poll(self) -> int | None:
        """The new thread count when it changed (already applied), else None."""
        if self._last is None or time.monotonic() - self._last.at < self.sample_every_s:
            return None
        now = cpu_sample()
        if now is None:
            self._last = None
            return None
        others = others_cores(self._last, now, self._machine_cores)
        self._last = now
        return self._propose(threads_for(self.cores, others))

    def _propose(self, threads: int) -> int | None:
        if threads == self.threads:
            self._proposal = None
            return None
        if self._proposal != threads:  # the first sample asking for it: wait for a second
            self._proposal = threads
            return None
        self._proposal = None
        self.threads = threads
        self.changes += 1
        return self.apply()
