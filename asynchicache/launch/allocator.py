"""How the engine process's C allocator keeps memory it freed, and in what pages.

A forward's activations are large and short-lived: for a 1,546-token prompt of
SmolLM2 the fused gate/up projection is 19 MB and the MLP's inner rows 9.5 MB,
allocated and freed in every layer. glibc's malloc hands blocks above its mmap
threshold (128 KiB at start, raised as such blocks are freed) to fresh mappings
or to the top of a heap that it trims back to the kernel once more than its trim
threshold (twice the mmap threshold) is free there; the next layer's block is
then faulted in again, 4 KiB at a time, inside the matmul that writes it. With
the mmap threshold at 32 MiB (its largest) and the trim threshold at 64 MiB, a
freed block stays in the heap for the next layer. Measured in one process (that
prompt's forward, 2 threads, medians of 5, alternating): 1.64 s -> 1.47-1.52 s with a
4 GiB trim threshold, 1.64 -> 1.57 s with today's 64 MiB (load ~2, one pair); a
later alternating run of steady forwards (64 MiB, 256 MiB, 1 GiB, 4 GiB, twice each,
docs/benchmarks.md 2026-12-05 13:40) saw no difference between the trim thresholds
beyond its noise (1.42-1.56 s). The memory kept is the forward's peak of activations;
the KV pool and the weights are above the threshold and mapped once.

It also asks glibc to back its large blocks with transparent huge pages
(`glibc.malloc.hugetlb=1`, glibc 2.35 and later; where the kernel's THP mode is
`madvise`, as here, nothing else gets them): a decode step reads every weight
(540 MB for SmolLM2) and every sequence's KV pages, and 4 KiB pages cost a page
walk each 4 KiB. Measured in one process each, alternating (2 threads): a decode
step of 8 sequences of 300 tokens 65.5-66.8 -> 60.6-62.0 ms; the 1,546-token
prefill 1.49-1.53 -> 1.44-1.49 s.

glibc reads these as the process starts, so they go into the engine process's
environment (`launch/launch.py`, like `launch/openmp.py`'s). An operator who tuned
malloc (or preloaded another allocator) keeps theirs; other C libraries ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value
# Twice the mmap threshold, the most glibc's own rule reaches: a layer's freed blocks
# (~30 MB at 1,546 tokens) stay, and no more is kept than glibc would keep anyway (the
# short soak's private-memory check grew +56 MB with 4 GiB here, +42 without settings).
TRIM_THRESHOLD_BYTES = 64 << 20
ALLOCATOR_KEEP = (
    ("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES)),
    ("MALLOC_TRIM_THRESHOLD_", str(TRIM_THRESHOLD_BYTES)),
    ("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"),  # older glibc ignores what it lacks
)
# Keys that say the operator tuned or replaced the allocator.
ALLOCATOR_KEYS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_ARENA_MAX",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)


def allocator_env(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What to add to the engine process's environment: `ALLOCATOR_KEEP`, unless
    `environ` (the operator's) already tunes or replaces the allocator."""
    if any(key in environ for key in ALLOCATOR_KEYS):
        return ()
    return ALLOCATOR_KEEP
