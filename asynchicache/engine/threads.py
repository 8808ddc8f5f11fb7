"""How many threads the engine's forward pass gets (torch intra-op threads).

On CPU the model's matmuls run on an OpenMP pool that ends each parallel
region at a barrier: if one of its threads is descheduled, every other thread
waits. The HTTP process (detokenizing, streaming) and the benchmark's client
run on the same cores, so a pool of every core stalls whenever they run. The
engine takes every core but one, as vLLM's CPU backend reserves one core per
engine for its scheduler and frontend; `asynchicache bench threads` measures
the alternatives on a given machine (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    return len(os.sched_getaffinity(0))


def default_threads(cores: int | None = None) -> int:
    """The engine's thread count when `--threads` is not given: cores - 1, at least 1."""
    n = available_cores() if cores is None else cores
    return max(1, n - 1)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads for this process (None: `default_threads()`)."""
    n = default_threads() if threads is None else threads
    torch.set_num_threads(n)
    return n
