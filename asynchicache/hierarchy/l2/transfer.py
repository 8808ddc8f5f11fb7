"""Asynchronous page copies between pools (L1 <-> L2): submit, then poll.

CPU: one worker thread copies runs of consecutive pages as slices. Measured on
the default model's pages (368 KiB each), a slice `copy_` per run moves
~13 GB/s, about the speed of one large `copy_`, while `index_select` +
`index_copy_` reaches only ~2 GB/s (it gathers into a temporary first).
Urgent copies (loads: a request waits for them, `submit(urgent=True)`) are
copied by the caller, inside `submit`, and are done when it returns; the
others (write-through, write-back: nobody waits) go to the thread, in order.
A hit's load used to go to the thread too, first in its queue (a long copy
yielded to it every 16 pages): under memory pressure every miss
writes its ~60 pages through to L2, and a load queued behind that missed the
step it could have joined; and even first in line, on two busy
cores (the forward's OpenMP threads, the HTTP process, a benchmark client)
the thread was often not scheduled within the step's bounded wait for it
(engine/scheduling/prefill_policy.py's `QuickLoads`, 20 ms at most): in a
16-client `bench pressure` run (2026-12-07, load 1-3) half of the L2 hits (39
of 78) were collected a step late, 0.4 s each on average, up to 1.1 s. The
copy itself is a memory copy of ~4-9 ms for a 1,000-token prefix (45 MB at
5-13 GB/s), much less than waiting for a starved thread can cost, so the
scheduler's thread copies: it is no I/O wait.
CUDA: copies run on a side stream that first waits for the compute stream; a
ticket is finished only once its event has completed, so nothing is published
before its bytes have landed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial

import torch

log = logging.getLogger(__name__)

SLICE_PAGES = 16  # pages of one slice copy (~6 MB here)


@dataclass(frozen=True)
class TransferDone:
    """A finished copy as `poll()` / `wait()` report it."""

    ticket: int
    num_pages: int
    num_bytes: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a page mapping into `(src_start, dst_start, length)` runs consecutive on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[tuple[int, int, int]] = []
    if not src_pages:
        return runs
    s0 = prev_s = src_pages[0]
    d0 = prev_d = dst_pages[0]
    for s, d in zip(src_pages[1:], dst_pages[1:], strict=True):
        if s == prev_s + 1 and d == prev_d + 1:
            prev_s, prev_d = s, d
            continue
        runs.append((s0, d0, prev_s - s0 + 1))
        s0 = prev_s = s
        d0 = prev_d = d
    runs.append((s0, d0, prev_s - s0 + 1))
    return runs


def copy_pages(
    src: torch.Tensor,
    src_pages: Sequence[int],
    dst: torch.Tensor,
    dst_pages: Sequence[int],
    non_blocking: bool = False,
) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]], one slice copy per run (never a fancy-index temp)."""
    # src, dst: [pages, layers, 2, page_size, kv_heads, head_dim]
    for s, d, n in page_runs(src_pages, dst_pages):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)


def copy_pieces(
    src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor, dst_pages: Sequence[int]
) -> list[Callable[[], None]]:
    """The slice copies of `copy_pages`, at most `SLICE_PAGES` pages each."""
    pieces: list[Callable[[], None]] = []
    for s, d, n in page_runs(src_pages, dst_pages):
        for i in range(0, n, SLICE_PAGES):
            k = min(SLICE_PAGES, n - i)
            pieces.append(partial(_copy_slice, src, dst, s + i, d + i, k))
    return pieces


def _copy_slice(src: torch.Tensor, dst: torch.Tensor, s: int, d: int, k: int) -> None:
    dst[d : d + k].copy_(src[s : s + k])


def copied_now(
    pieces: list[Callable[[], None]], future: Future[None] | None = None
) -> Future[None]:
    """Run `pieces` on this thread; `future` (a new one by default) done, with the error
    if one raised."""
    future = Future() if future is None else future
    try:
        for piece in pieces:
            piece()
    except Exception as exc:  # reported through the ticket, as the worker would
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future


@dataclass
class _Work:
    pieces: list[Callable[[], None]]
    future: Future[None] = field(default_factory=Future)


class _CopyWorker:
    """One thread copying background work (write-through, write-back), in order."""

    def __init__(self) -> None:
        self._queue: deque[_Work] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def submit(self, pieces: list[Callable[[], None]]) -> Future[None]:
        work = _Work(pieces)
        with self._cond:
            self._queue.append(work)
            self._cond.notify()
        return work.future

    def _next(self) -> _Work | None:
        """The work to do next; None once stopped and idle."""
        with self._cond:
            while not (self._queue or self._stopping):
                self._cond.wait()
            return self._queue.popleft() if self._queue else None

    def _run(self) -> None:
        while (work := self._next()) is not None:
            copied_now(work.pieces, work.future)  # an error is reported through the ticket

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()


@dataclass
class _Pending:
    num_pages: int
    num_bytes: int
    future: Future[None] | None = None
    event: torch.cuda.Event | None = None
    keep: tuple[torch.Tensor, ...] = ()  # tensors the in-flight copy reads or writes
    error: str | None = None
    urgent: bool = False


class TransferEngine:
    """Moves pages between pool tensors in the background; `poll()` never blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pending: dict[int, _Pending] = {}
        self._next_ticket = 0
        self._lock = threading.Lock()  # only guards ticket numbering against stray threads
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._worker = None if self._cuda else _CopyWorker()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(
        self,
        src: torch.Tensor,
        src_pages: Sequence[int],
        dst: torch.Tensor,
        dst_pages: Sequence[int],
        urgent: bool = False,
    ) -> int:
        """Start copying `src[src_pages[i]]` to `dst[dst_pages[i]]`; returns a ticket at once.
        `urgent`: someone waits for it (a load); on CPU it is copied now, on this thread."""
        src_pages, dst_pages = list(src_pages), list(dst_pages)
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destinations")
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
        page_bytes = src[0].numel() * src.element_size() if len(src) else 0
        urgent = urgent and not self._cuda  # CUDA copies keep one stream, in order
        job = _Pending(len(src_pages), len(src_pages) * page_bytes, urgent=urgent)
        try:
            if self._cuda:
                self._submit_cuda(job, src, src_pages, dst, dst_pages)
            else:
                assert self._worker is not None
                pieces = copy_pieces(src, src_pages, dst, dst_pages)
                job.future = copied_now(pieces) if urgent else self._worker.submit(pieces)
        except Exception as exc:  # a bad submit reports as a failed ticket, not a crash
            log.exception("page copy submit failed")
            job.error = f"{type(exc).__name__}: {exc}"
        self._pending[ticket] = job
        return ticket

    def _submit_cuda(
        self,
        job: _Pending,
        src: torch.Tensor,
        src_pages: list[int],
        dst: torch.Tensor,
        dst_pages: list[int],
    ) -> None:
        assert self._stream is not None
        # The side stream must not read L1 before the model finished writing it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            copy_pages(src, src_pages, dst, dst_pages, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        job.event = event
        job.keep = (src, dst)

    def _finished(self, job: _Pending) -> bool:
        if job.error is not None:
            return True
        if job.future is not None:
            return job.future.done()
        return job.event is None or job.event.query()

    def _result(self, ticket: int, job: _Pending) -> TransferDone:
        error = job.error
        if error is None and job.future is not None:
            exc = job.future.exception()
            if exc is not None:
                log.error("page copy %d failed: %s", ticket, exc)
                error = f"{type(exc).__name__}: {exc}"
        return TransferDone(ticket, job.num_pages, job.num_bytes, error)

    def poll(self) -> list[TransferDone]:
        """Copies finished since the last call, in submission order. Never blocks.

        Background copies finish in submission order (one worker, one stream): checking
        each in turn, a later one could finish between two checks and be reported first,
        so the first unfinished one stops them. Urgent copies may overtake them and are
        reported as soon as they finished."""
        done, blocked = [], False
        for t, job in self._pending.items():
            if (job.urgent or not blocked) and self._finished(job):
                done.append(t)
            elif not job.urgent:
                blocked = True
        return [self._result(t, self._pending.pop(t)) for t in done]

    def wait(self, ticket: int, timeout: float | None = None) -> TransferDone:
        """Block until `ticket` finished (tests, write-back eviction, shutdown).

        The result is returned here and not reported again by `poll()`.
        """
        self._await(self._pending[ticket], timeout, f"page copy {ticket}")
        return self._result(ticket, self._pending.pop(ticket))

    def flush(self, timeout: float | None = None) -> None:
        """Block until every submitted copy has finished; `poll()` still reports them.

        For tests that need completions to be deterministic, and for shutdown.
        """
        for job in list(self._pending.values()):
            self._await(job, timeout, "page copies")

    @staticmethod
    def _await(job: _Pending, timeout: float | None, what: str) -> None:
        if job.future is not None:
            try:
                job.future.exception(timeout=timeout)
            except FutureTimeout:
                raise TimeoutError(f"{what} not done after {timeout} s") from None
        elif job.event is not None:
            job.event.synchronize()

    def close(self) -> None:
        """Finish every copy in flight, then stop the worker."""
        for ticket in list(self._pending):
            self.wait(ticket)
        if self._worker is not None:
            self._worker.close()
