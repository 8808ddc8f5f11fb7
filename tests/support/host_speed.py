"""How fast this host runs the engine's work, measured once per test run, so that timeouts
follow the host (and its load) instead of the fast host they were first set on.

The measure: one torch thread, a prompt's worth of SmolLM2-shaped work: its MLP's matmuls
over 256 rows and one layer's attention over 512 prompt rows in the native kernel this
host runs (torch's attention where none builds). Those are what a test's server spends
its time on; an AVX2 host whose kernels lost to AVX-512 ones, or a machine shared with
other runs, shows up here as it does in the tests.

`slowdown()` is that time over the reference host's (Intel Xeon, Sapphire Rapids with
AVX-512, 2 cores, quiet), at least 1 (timeouts never shrink below what the tests were
written with) and at most MAX_SLOWDOWN. The first call measures and keeps the figure in
the environment (ASYNCHICACHE_TEST_SLOWDOWN), so the servers and xdist workers a run
starts inherit it: one calibration per run. Setting it by hand fixes the figure.
"""

from __future__ import annotations

import math
import os
import time

import torch

SLOWDOWN_ENV = "ASYNCHICACHE_TEST_SLOWDOWN"
REFERENCE_S = 0.030  # the work below on the reference host, quiet (best of 5)
MAX_SLOWDOWN = 20.0
ROWS, HIDDEN, INTER = 256, 576, 1536  # SmolLM2-135M's widths
PROMPT, HEADS, KV_HEADS, HEAD_DIM, PAGE = 512, 9, 3, 64, 16


def _work() -> object:
    """A closure doing the measured work once (its inputs made beforehand)."""
    from asynchicache.model import native
    from asynchicache.model.native import KernelWork

    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, generator=g)
    gate_up = torch.randn(2 * INTER, HIDDEN, generator=g)
    down = torch.randn(HIDDEN, INTER, generator=g)
    pages = PROMPT // PAGE
    pool = torch.randn(pages, 2, PAGE, KV_HEADS, HEAD_DIM, generator=g)
    q = torch.randn(PROMPT, HEADS, HEAD_DIM, generator=g)
    out = torch.empty_like(q)
    kernel = native.load()
    tasks = KernelWork.count_tasks([PROMPT], KV_HEADS, HEADS // KV_HEADS)
    work = KernelWork(torch.arange(pages), torch.tensor([[0, 0, PROMPT, 0]]), 0.125, tasks)

    def run() -> None:
        h = x @ gate_up.T  # [ROWS, 2 INTER]
        _ = h[:, :INTER] @ down.T
        if kernel is not None:
            kernel(pool[:, 0], pool[:, 1], q, out, work, 0)
        else:
            k = pool[:, 0].flatten(0, 1).transpose(0, 1)[None]  # [1, kv_heads, keys, hd]
            v = pool[:, 1].flatten(0, 1).transpose(0, 1)[None]
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=True
            )

    return run


def measure(repeats: int = 5) -> float:
    """Seconds of the work on one torch thread, best of `repeats` (after one warm-up)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = _work()
        run()  # type: ignore[operator]
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            run()  # type: ignore[operator]
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(previous)


def slowdown() -> float:
    """This host against the reference host (>= 1; measured once per run, see above)."""
    given = os.environ.get(SLOWDOWN_ENV)
    if given:
        return min(MAX_SLOWDOWN, max(1.0, float(given)))
    factor = min(MAX_SLOWDOWN, max(1.0, measure() / REFERENCE_S))
    os.environ[SLOWDOWN_ENV] = f"{factor:.3f}"
    return factor


def scaled(seconds: float) -> float:
    """`seconds` (a timeout set on the reference host) for this host."""
    return seconds * slowdown()
