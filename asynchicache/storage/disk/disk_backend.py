"""L3: pages as self-describing, checksummed files under `--disk-cache-dir`.

Folder layout (content-addressed, so several services may share it; see
storage.disk.names):

    <root>/ns-<namespace id>/<first 2 hex of hash>/<32 hex of hash>.kv

One file per page: a default-model page is 737,280 bytes, large enough that
per-page files reach the disk's bandwidth with a few threads in flight (see
docs/benchmarks.md), so no multi-page container files are needed.

Writes go to `.tmp-*` in the same folder and are `os.replace`d once complete
and durable: a crash never leaves half a file under a real name. A put writes
its temp files in parallel, then makes them durable with one `syncfs` (one
device flush for the batch; an fdatasync per file costs a flush per page, a
third of the write bandwidth here), then renames them. Reads land straight in the
L2 slot (`os.preadv` into a memoryview of the shared pool) and are verified
(header fields, length, xxh3_128 of the payload) before they count; anything
wrong is a miss, the file is removed and `corrupt_detected` counts it.

The index is rebuilt from the headers at start in a background thread; file
mtimes carry the LRU order across restarts (reads and writes stamp them,
prefix newest).

A folder shared by live services (storage.disk.space, storage.disk.folder_ledger):
a page's file name is known from its hash, so a chain the index does not hold
is looked up in the folder and files that verify are adopted (`exists`,
`get`, and `put` before writing a page another service wrote meanwhile); a
page another service evicted is a miss at read time and leaves the index. The
capacity is the folder's, kept in one ledger that every writer updates under
an fcntl lock, so several writers keep the folder under its size.

Pins (storage.disk.pins) keep chains from eviction, by this service and by every
other one using the folder. Clears (storage.disk.clear) remove a namespace's
pages, or one chain root's, keeping pinned pages unless asked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from concurrent.futures import ThreadPoolExecutor as _Pool
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from asynchicache.common.deadline import Deadline
from asynchicache.common.fileio import (
    Scratch,
    direct_possible,
    make_private_dir,
    set_mtime,
)
from asynchicache.common.tiers import Tier
from asynchicache.storage.admin_messages import Pin
from asynchicache.storage.base import (
    BackendStats,
    Cleared,
    ClearScope,
    Hashes,
    PageRef,
    Slots,
    StatsCounter,
    StorageBackend,
    check_pool,
    check_read,
)
from asynchicache.storage.disk.adopt import FolderAdoption
from asynchicache.storage.disk.clear import drop_pins, plan_clear
from asynchicache.storage.disk.disk_config import DiskConfig, IoBatch
from asynchicache.storage.disk.disk_pins import (
    PinLimit,
    PinStore,
    check_limit,
    folder_pinned_bytes,
    pin_id_of,
)
from asynchicache.storage.disk.folder import check_disk_folder
from asynchicache.storage.disk.names import (
    PAGE_SUFFIX,
    TMP_PREFIX,
    namespace_dir_name,
    page_file_name,
    page_path,
    parse_page_file_name,
    unlink_size,
)
from asynchicache.storage.disk.namespace_meta import write_meta
from asynchicache.storage.disk.page_file import PageFiles
from asynchicache.storage.disk.scan import scan_folder
from asynchicache.storage.disk.space import DiskSpace
from asynchicache.storage.disk.write import PageWriter, prefix_within
from asynchicache.storage.events import EventLog
from asynchicache.storage.header import header_len_for
from asynchicache.storage.page_index import IndexedPage, PageIndex
from asynchicache.storage.page_keys import MacMismatch

T = TypeVar("T")

__all__ = [
    "PAGE_SUFFIX",
    "TMP_PREFIX",
    "DiskBackend",
    "DiskConfig",
    "check_pool",
    "namespace_dir_name",
    "page_file_name",
    "parse_page_file_name",
]

log = logging.getLogger(__name__)

# A read re-stamps a page file (its mtime is the LRU stamp) only when older than this.
RESTAMP_AFTER_NS = 60 * 10**9


@dataclass(frozen=True)
class PinResult:
    """A pin written: the pin, how many leading pages of its chain are stored, the limit."""

    pin: Pin
    pages_present: int
    limit: PinLimit


class DiskBackend(StorageBackend):
    """StorageBackend over a folder of page files (see the module docstring)."""

    def __init__(self, config: DiskConfig, events: EventLog | None = None) -> None:
        self.config = config
        self.namespace = config.namespace
        self.layout = config.layout
        self.page_bytes = config.layout.page_bytes
        self._folder = config.folder
        check_disk_folder(config.disk_cache_dir)
        make_private_dir(config.disk_cache_dir)
        check_disk_folder(self._folder, "a namespace folder of --disk-cache-dir")
        make_private_dir(self._folder)
        write_meta(self._folder, config.namespace, config.layout)
        self.events = events or EventLog()
        self._index = PageIndex(self.events.index_listener(Tier.DISK))
        keys = config.keys.for_namespace(config.namespace) if config.keys else None
        self._files = PageFiles(config.namespace, config.layout, keys)
        self.pins = PinStore(self._folder)
        self._space = DiskSpace(
            config.disk_cache_dir,
            self._folder,
            config.disk_cache_bytes,
            self._index,
            self.pins,
            self._path,
        )
        self._stats = StatsCounter(BackendStats(capacity_bytes=config.disk_cache_bytes))
        self._count = self._stats.add
        self._io = _Pool(config.io_threads, thread_name_prefix="disk-io")
        self._scratch = Scratch()
        self._adoption = FolderAdoption(
            self._files, self._index, self._path, config.page_file_bytes, self._count
        )
        self._writer = PageWriter(self._files, config, self._scratch, self._path, self._count)
        self._closing = threading.Event()
        self._scan_done = threading.Event()
        self._scanner = threading.Thread(target=self._scan, name="disk-scan", daemon=True)
        self._scanner.start()
        self._scan_done.wait(config.scan_wait_s)

    # -- StorageBackend -------------------------------------------------

    def exists(self, hashes: Sequence[bytes]) -> int:
        """Leading pages of the chain stored: indexed, or found in the folder and adopted."""
        n = self._index.leading(hashes)
        if n < len(hashes) and self.ready:
            n += self._adoption.adopt(hashes[n:], hashes[n - 1] if n else b"")
        return n

    def get(
        self, hashes: Hashes, slots: Slots, pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Read pages into their slots; pages not started by `deadline` are misses.

        Returns only once no read into `pool` is in flight, even when one failed.
        """
        check_read(hashes, slots, pool, self.page_bytes)
        # Before the scan finished the index is partial: try the files anyway.
        n = len(hashes) if not self.ready else self.exists(hashes)
        batch = self._batch(pool, deadline)
        futures = [
            self._io.submit(self._read_one, h, s, batch)
            for h, s in zip(hashes[:n], slots[:n], strict=True)
        ]
        reads = _results(futures)
        ok = next((i for i, r in enumerate(reads) if r is None), n)
        self._index.add_chain([r for r in reads[:ok] if r is not None])  # all of them
        self._restamp(hashes[:ok], batch.stamp_ns)
        self._count(
            hits=ok,
            misses=len(hashes) - ok,
            pages_read=ok,
            bytes_read=ok * self.page_bytes,
            direct_reads=ok if batch.direct and self._writer.direct else 0,
        )
        return ok

    def put(
        self, pages: Sequence[PageRef], pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Write pages from `pool[page.slot]`; pages not started by `deadline` are not stored.

        The cache service passes private copies of the L2 slots (see `storage.service.tiered`).
        Returns only once no write from `pool` is in flight.
        """
        check_pool(pool, self.page_bytes, [p.slot for p in pages])
        age: dict[bytes, int] = {}  # position in the chain: 0 ends most recent
        for i, p in enumerate(pages):
            age.setdefault(p.page_hash, i)
        batch = self._batch(pool, deadline)
        todo = self._new_pages(pages)
        sizes = [self._file_size(len(p.tokens)) for p in todo]
        granted = self._space.reserve(sum(sizes))
        fits = prefix_within(sizes, granted)
        errors = self._write_all(todo[:fits], batch, age)
        errors.update({p.page_hash: "over capacity" for p in todo[fits:]})
        written = {h for h, err in errors.items() if err is None}
        used = sum(size for p, size in zip(todo, sizes, strict=True) if p.page_hash in written)
        self._space.release(granted - used)
        info = {p.page_hash: self._entry(p) for p in reversed(pages)}
        kept = [info[h] for h in age if errors.get(h) is None]
        # Pages skipped as already indexed count only if no concurrent put evicted them.
        indexed = self._index.commit(kept, written)
        self._index.record_stamps((h, batch.stamp_ns - age[h]) for h in written)
        self._restamp([h for h in age if h not in written and h in indexed], batch.stamp_ns)
        self._count_writes(len(todo), [e for e in errors.values() if e is not None])
        return sum(p.page_hash in indexed for p in pages)

    def delete(self, hashes: Sequence[bytes]) -> int:
        self._index.remove_many(hashes)
        freed = [unlink_size(self._path(h)) for h in hashes]
        self._space.release(sum(freed))
        return sum(f > 0 for f in freed)

    def clear(self, scope: ClearScope = ClearScope()) -> Cleared:  # noqa: B008 (frozen)
        """Remove the namespace's page files in `scope` (any process's); see storage.disk.clear."""
        pinned = self._space.refresh_pins()
        plan = plan_clear(self._folder, scope, pinned, self._index.parents())
        if not scope.root and (scope.include_pinned or not pinned):
            self._index.clear()  # everything goes: one AllBlocksCleared event
        else:
            self._index.remove_many(h for h, _ in plan.targets)
        freed = [unlink_size(path) for _, path in plan.targets]
        self._space.release(sum(freed))
        drop_pins(self.pins, scope)
        self._space.refresh_pins()
        return Cleared(sum(f > 0 for f in freed), plan.pinned_kept)

    def stats(self) -> BackendStats:
        snap = self._stats.snapshot()
        snap.pages = len(self._index)
        snap.bytes_used = self._index.bytes_used
        snap.evictions = self._space.counters.evictions
        snap.extra["index_ready"] = float(self.ready)
        snap.extra["io_threads"] = float(self.config.io_threads)
        snap.extra["folder_bytes"] = float(self._space.ledger.peek())
        snap.extra["other_namespaces_bytes"] = float(self._space.budget.other_bytes)
        snap.extra["stale_namespace_evictions"] = float(self._space.budget.stale_evicted_pages)
        snap.extra["unindexed_evictions"] = float(self._space.counters.unindexed_evictions)
        snap.extra["pinned_pages"] = float(self._index.pinned_pages)
        snap.extra["pins"] = float(len(self.pins.active()))
        return snap

    def close(self) -> None:
        self._closing.set()
        self._scanner.join(timeout=5.0)
        self._io.shutdown(wait=True)
        self._space.close()

    # -- pins and contents ----------------------------------------------------

    def pin(
        self, pages: Sequence[bytes], root: bytes, owner: str = "", ttl_s: float | None = None
    ) -> PinResult:
        """Keep a chain from eviction (see storage.disk.pins); raises PinLimitError over the cap."""
        if not pages:
            raise ValueError("a pin needs at least one page")
        now = time.time()
        pin = Pin(
            pin_id_of(pages),
            root,
            tuple(pages),
            self.config.page_file_bytes,
            owner,
            now,
            None if ttl_s is None else now + ttl_s,
        )
        limit_bytes = int(self.config.max_pinned_fraction * self.config.disk_cache_bytes)
        with self._space.ledger.locked():
            limit = check_limit(self.config.disk_cache_dir, self._folder, pin, limit_bytes, now)
            self.pins.write(pin)
        self._space.refresh_pins()
        return PinResult(pin, self.exists(pages), limit)

    def pin_usage(self) -> PinLimit:
        """The folder's pinned bytes now (every namespace) and what pins may hold."""
        pinned = folder_pinned_bytes(self.config.disk_cache_dir, time.time())
        return PinLimit(pinned, int(self.config.max_pinned_fraction * self.config.disk_cache_bytes))

    @property
    def pinned_pages(self) -> int:
        """Pinned pages stored on disk (indexed) now."""
        return self._index.pinned_pages

    def unpin(self, pin_ids: Sequence[str]) -> int:
        removed = self.pins.remove(pin_ids)
        self._space.refresh_pins()
        return removed

    def contents(
        self, mark: Callable[[], int] = lambda: 0
    ) -> tuple[list[tuple[bytes, bytes]], int]:
        """(hash, parent) of every indexed page, and `mark()` (the event sequence) at that
        instant."""
        return self._index.snapshot(mark)

    # -- extras ---------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the start-up scan has indexed every file."""
        return self._scan_done.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._scan_done.wait(timeout)

    def path_of(self, page_hash: bytes) -> Path:
        """Where a page's file lives (for tests and the CLI)."""
        return self._path(page_hash)

    def lru_order(self) -> list[bytes]:
        """Unpinned page hashes from the next eviction victim to the most recently used."""
        return self._index.lru_order()

    # -- internals ------------------------------------------------------

    def _path(self, page_hash: bytes) -> Path:
        return page_path(self._folder, page_hash)

    def _file_size(self, n_tokens: int) -> int:
        return header_len_for(len(self.config.namespace), n_tokens, self.layout) + self.page_bytes

    def _entry(self, page: PageRef) -> IndexedPage:
        return IndexedPage(
            page.page_hash, self._file_size(len(page.tokens)), page.parent, page.tokens
        )

    def _batch(self, pool: np.ndarray, deadline: Deadline | None) -> IoBatch:
        direct = self._writer.direct and direct_possible(self.page_bytes, pool)
        return IoBatch(pool, time.time_ns(), direct, deadline)

    def _new_pages(self, pages: Sequence[PageRef]) -> list[PageRef]:
        """Pages to write: not indexed, not in the folder already (those are adopted)."""
        seen: set[bytes] = set()
        todo = []
        for p in pages:
            h = p.page_hash
            if h in self._index or h in seen:
                continue
            seen.add(h)
            if not self._adoption.adopt([h], p.parent):
                todo.append(p)
        return todo

    def _write_all(
        self, todo: Sequence[PageRef], batch: IoBatch, age: dict[bytes, int]
    ) -> dict[bytes, str | None]:
        """Write pages; error text per page (None: stored). See storage.disk.write."""
        futures = [
            self._io.submit(self._writer.write_temp, p, batch, batch.stamp_ns - age[p.page_hash])
            for p in todo
        ]
        temps = dict(zip((p.page_hash for p in todo), _results(futures), strict=True))
        return self._writer.publish(temps, batch.direct)

    def _count_writes(self, attempted: int, errors: Sequence[str]) -> None:
        written = attempted - len(errors)
        self._count(
            pages_written=written,
            bytes_written=written * self.page_bytes,
            store_failures=len(errors),
        )
        if errors:
            log.warning(
                "disk put: %d of %d new pages not stored: %s", len(errors), attempted, errors[0]
            )

    def _restamp(self, chain: Sequence[bytes], stamp_ns: int) -> None:
        """Persist the LRU position of pages just read, first page newest.

        Only pages whose file stamp is older than RESTAMP_AFTER_NS: a read then
        costs no metadata write in the common case, and the order a restart
        recovers is right to within that age.
        """
        due = set(self._index.due_stamps(chain, stamp_ns, RESTAMP_AFTER_NS))
        done = []
        for i, h in enumerate(chain):
            if h in due:
                set_mtime(self._path(h), stamp_ns - i)
                done.append((h, stamp_ns - i))
        self._index.record_stamps(done)

    def _discard(self, page_hash: bytes, path: Path, reason: str) -> None:
        log.warning("disk page %s: %s; removing it", page_hash.hex(), reason)
        self._adoption.verified(page_hash)
        self._index.remove(page_hash)
        self._space.release(unlink_size(path))
        self._count(corrupt_detected=1)
        if isinstance(reason, MacMismatch):
            self._count(mac_failures=1)

    def _read_one(self, page_hash: bytes, slot: int, batch: IoBatch) -> IndexedPage | None:
        """Read and verify one page into its slot; its index entry, or None on a miss."""
        if batch.late():
            self._count(late_skipped=1)
            return None
        dst = memoryview(batch.pool[slot])
        path = self._path(page_hash)
        if not self._adoption.verify(page_hash, self._discard):
            return None
        try:
            fd, direct = self._writer.open_read(path, batch.direct)
        except FileNotFoundError:
            # Evicted by another service on this folder (or removed by hand): a miss.
            if self._index.remove(page_hash) is not None:
                self._count(corrupt_detected=1, vanished=1)
            return None
        except OSError as exc:
            log.warning("disk page %s: cannot open: %s", page_hash.hex(), exc)
            self._count(read_errors=1)
            return None
        try:
            result = self._files.read_into(fd, page_hash, dst, direct, self._scratch)
        except OSError as exc:
            result = f"read failed: {exc}"
        finally:
            os.close(fd)
        if isinstance(result, str):
            self._discard(page_hash, path, result)
            return None
        size, header = result
        self._adoption.verified(page_hash)
        return IndexedPage(page_hash, size, header.parent, header.tokens)

    def _scan(self) -> None:
        try:
            if scan_folder(self._folder, self._files, self._index, self._discard, self._closing):
                self._space.budget.refresh()
                self._space.recount()  # the folder's usage, then trimmed to the capacity
                log.info(
                    "disk index ready: %d pages, %.1f MB in %s",
                    len(self._index),
                    self._index.bytes_used / 1e6,
                    self._folder,
                )
        except Exception:
            log.exception("disk index scan of %s failed", self._folder)
            self._count(scan_failures=1)
            self._index.end_scan()
        finally:
            self._scan_done.set()


def _results(futures: Sequence[Future[T]]) -> list[T]:
    """Every future's result, after all of them finished: a job that fails must not
    return (and be answered) while its other pages are still being read or written."""
    wait(futures)
    return [f.result() for f in futures]
