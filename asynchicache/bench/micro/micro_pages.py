"""What the disk and redis micro-benchmarks share: the default model's page, an L2 pool of
distinct pages in shared memory, and the timed put/get loops (every page checked after)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from asynchicache.common.shm import SharedSegment
from asynchicache.storage.base import PageLayout, PageRef

DEFAULT_LAYOUT = PageLayout("float32", (30, 2, 16, 3, 64))
MB = 1 << 20


class PageStore(Protocol):
    """The two calls of a storage backend the loops time."""

    def put(self, pages: Sequence[PageRef], pool: np.ndarray) -> int: ...

    def get(self, hashes: Sequence[bytes], slots: Sequence[int], pool: np.ndarray) -> int: ...


def pages_for(total_mb: int) -> int:
    """How many default-model pages make `total_mb` MiB (at least one)."""
    return max(1, total_mb * MB // DEFAULT_LAYOUT.page_bytes)


@contextmanager
def bench_pool(pages: int) -> Iterator[np.ndarray]:
    """A shared-memory pool `[2 * pages, page_bytes]` uint8: `pages` distinct pages to write,
    then as many slots to read them back into. Unlinked on exit."""
    segment = SharedSegment.create(2 * pages * DEFAULT_LAYOUT.page_bytes, tag="bench")
    try:
        pool = segment.as_array().reshape(2 * pages, DEFAULT_LAYOUT.page_bytes)
        _fill(pool, pages)
        yield pool
        del pool
    finally:
        segment.close()


def _fill(pool: np.ndarray, pages: int) -> None:
    # [pages, page_bytes]: one random page, made distinct per page so every checksum differs.
    base = np.frombuffer(os.urandom(pool.shape[1]), dtype=np.uint8)
    for i in range(pages):
        pool[i] = base
        pool[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)


def put_all(store: PageStore, pool: np.ndarray, hashes: list[bytes], step: int) -> float:
    """Seconds to store pages 0.. of `pool` under `hashes`, `step` pages per call."""
    refs = [PageRef(h, tuple(range(16)), i) for i, h in enumerate(hashes)]
    t0 = time.perf_counter()
    for k in range(0, len(refs), step):
        if store.put(refs[k : k + step], pool) != len(refs[k : k + step]):
            raise RuntimeError("the benchmark's put did not store every page")
    return time.perf_counter() - t0


def get_all(store: PageStore, pool: np.ndarray, hashes: list[bytes], step: int) -> float:
    """Seconds to read `hashes` into the second half of `pool`; fails unless every page
    read equals the page written."""
    pages = len(hashes)
    pool[pages:] = 0
    t0 = time.perf_counter()
    for k in range(0, pages, step):
        slots = list(range(pages + k, pages + min(pages, k + step)))
        if store.get(hashes[k : k + step], slots, pool) != len(slots):
            raise RuntimeError("the benchmark's get missed pages")
    seconds = time.perf_counter() - t0
    if not np.array_equal(pool[pages:], pool[:pages]):
        raise RuntimeError("pages read back differ from pages written")
    return seconds


def section_main(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    measure: Callable[[argparse.Namespace], dict],
    argv: list[str] | None,
) -> int:
    """`python -m asynchicache.bench.micro_<section>`: parse, measure, print the JSON."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    print(json.dumps(measure(parser.parse_args(argv)), indent=2))
    return 0
