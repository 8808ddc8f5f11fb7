"""How the engine's OpenMP threads wait between parallel regions.

torch's CPU matmuls and element-wise ops run on an OpenMP pool (libgomp in the
PyPI wheels). A pool thread that finished its share of a region spins before
it sleeps (libgomp: up to ~300,000 turns, about a millisecond), hoping for the
next region. On a machine whose cores are all the engine's that is free; here
they are not: the HTTP process, the cache service and the clients run on the
same two cores (our native kernels now run on OpenMP's own threads,
model/native.py; when this was measured they ran on a Python worker beside
them). A spinning pool thread
then takes the core another of our threads needs, and a descheduled one holds
every other at the region's closing barrier. Measured in one process, one
512-token chunk over 512 cached tokens, best of 6, other processes' load ~4
on 2 cores: 2 threads took 1.9-3.0 s with the default spinning (1 thread:
0.9 s) and 0.95-1.5 s with `OMP_WAIT_POLICY=PASSIVE`, using no more CPU than
one thread. More figures (not yet from a quiet machine): docs/benchmarks.md,
`python -m asynchicache.bench.micro.openmp_wait`.

The runtime reads these settings once, as it loads (when the engine process
imports torch), so they go into the environment of the engine process when it
is started (`launch/launch.py`, through `ChildSpec.env`). An operator who set
any of them keeps theirs.
"""

from __future__ import annotations

from collections.abc import Mapping

OPENMP_WAIT = (("OMP_WAIT_POLICY", "PASSIVE"),)
# Keys that say how OpenMP threads wait, in libgomp's and Intel OpenMP's words.
OPENMP_WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def openmp_env(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What to add to the engine process's environment: `OPENMP_WAIT`, unless `environ`
    (the operator's) already says how OpenMP threads wait."""
    if any(key in environ for key in OPENMP_WAIT_KEYS):
        return ()
    return OPENMP_WAIT
