"""Background writes from private copies of L2 pages.

A store's L2 slots belong to the engine again as soon as the service replies,
so a write that should finish later (disk -> remote upload, remote -> disk
promotion) cannot read them then. `stage()` copies the pages into a private,
page-aligned buffer (one batched copy; O_DIRECT-friendly), and `WriteBehind`
hands staged batches to a sink (`backend.put`) on its own thread.

The bytes staged at once are bounded: when a batch does not fit, `submit`
says so and the caller decides (write now from the slots, or skip). A sink
that raises is logged and counted; the worker keeps going.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from asynchicache.storage.base import PageRef

log = logging.getLogger(__name__)

Sink = Callable[[Sequence[PageRef], np.ndarray], int]


@dataclass
class StagedPages:
    """Private copies of pages: `refs[i].slot == i` indexes `pool` `[pages, page_bytes]`."""

    refs: list[PageRef]
    pool: np.ndarray
    _buffer: mmap.mmap = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def release(self) -> None:
        del self.pool
        try:
            self._buffer.close()
        except BufferError:  # a sink kept a view; the mapping goes with it
            log.debug("staged buffer still viewed; left to the garbage collector")


def stage(pages: Sequence[PageRef], pool: np.ndarray) -> StagedPages:
    """Copy `pool[page.slot]` of every page into a fresh page-aligned buffer."""
    page_bytes = pool.shape[1]
    buffer = mmap.mmap(-1, max(1, len(pages) * page_bytes))
    # [pages, page_bytes] uint8
    private = np.frombuffer(buffer, dtype=np.uint8, count=len(pages) * page_bytes)
    private = private.reshape(len(pages), page_bytes)
    # mode="clip": slots were range-checked; the default "raise" buffers the whole copy once more.
    np.take(pool, [p.slot for p in pages], axis=0, out=private, mode="clip")
    refs = [PageRef(p.page_hash, p.tokens, i) for i, p in enumerate(pages)]
    return StagedPages(refs, private, buffer)


@dataclass
class _Job:
    staged: StagedPages
    sink: Sink


class WriteBehind:
    """One worker thread writing staged batches, at most `budget_bytes` staged at a time."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"{name}: write-behind budget must be positive")
        self.name = name
        self.budget_bytes = budget_bytes
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._staged_bytes = 0
        self.counters: dict[str, int] = {
            "batches": 0,
            "pages": 0,
            "pages_stored": 0,
            "failures": 0,
            "over_budget": 0,
        }
        self._worker = threading.Thread(target=self._run, name=f"write-behind-{name}", daemon=True)
        self._worker.start()

    def submit(self, pages: Sequence[PageRef], pool: np.ndarray, sink: Sink) -> bool:
        """Stage `pages` and queue them for `sink`; False (nothing staged) when over budget."""
        nbytes = len(pages) * pool.shape[1]
        with self._cond:
            if self._staged_bytes + nbytes > self.budget_bytes:
                self.counters["over_budget"] += 1
                return False
            self._staged_bytes += nbytes
        try:
            staged = stage(pages, pool)
        except BaseException:
            self._release(nbytes)
            raise
        self._queue.put(_Job(staged, sink))
        return True

    @property
    def staged_bytes(self) -> int:
        return self._staged_bytes

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything submitted was written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._staged_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued writes (up to `timeout_s`), then stop the worker."""
        if not self.drain(timeout_s):
            log.warning("%s: %d bytes not written at close", self.name, self._staged_bytes)
        self._queue.put(None)
        self._worker.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            nbytes = job.staged.nbytes
            try:
                stored = job.sink(job.staged.refs, job.staged.pool)
                self._counted(len(job.staged.refs), stored)
            except Exception:
                log.exception("%s: background write failed", self.name)
                with self._cond:
                    self.counters["failures"] += 1
            finally:
                job.staged.release()
                self._release(nbytes)

    def _counted(self, pages: int, stored: int) -> None:
        with self._cond:
            self.counters["batches"] += 1
            self.counters["pages"] += pages
            self.counters["pages_stored"] += stored

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._staged_bytes -= nbytes
            self._cond.notify_all()
