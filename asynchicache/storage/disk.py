"""L3: pages as self-describing, checksummed files under `--disk-cache-dir`.

Folder layout (content-addressed, so several services may share it):

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
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import numpy as np
import xxhash

from asynchicache.storage.base import BackendStats, PageLayout, PageRef
from asynchicache.storage.deadline import Deadline, passed
from asynchicache.storage.disk_folder import FolderBudget, NamespaceLease
from asynchicache.storage.fileio import (
    DIRECT_ALIGN,
    Scratch,
    clear_direct,
    create_private,
    direct_possible,
    make_private_dir,
    open_read,
    preadv_all,
    pwritev_all,
    set_mtime,
    syncfs,
)
from asynchicache.storage.header import (
    HeaderError,
    PageHeader,
    decode_header,
    encode_header,
    header_len_for,
    payload_checksum,
    peek_header_len,
)
from asynchicache.storage.page_index import PageIndex, ScannedPage

log = logging.getLogger(__name__)

PAGE_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
# A temp file this old belongs to a writer that died (a live one renames in ms).
STALE_TMP_S = 600.0
# A read re-stamps a page file (its mtime is the LRU stamp) only when older than this.
RESTAMP_AFTER_NS = 60 * 10**9


def namespace_dir_name(namespace: bytes) -> str:
    """The folder of one namespace: derived from its bytes, stable across processes."""
    return "ns-" + xxhash.xxh3_64_hexdigest(b"asynchicache-ns-dir\x00" + namespace)


def page_file_name(page_hash: bytes) -> str:
    return page_hash.hex() + PAGE_SUFFIX


def parse_page_file_name(name: str) -> bytes | None:
    """The page hash a file name stands for, or None when it is not a page file."""
    stem = name[: -len(PAGE_SUFFIX)] if name.endswith(PAGE_SUFFIX) else ""
    if len(stem) != 32:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


class SyncMode(StrEnum):
    """How a put makes its pages durable before they get their real names.

    Correctness never depends on it (every read is verified; a crash leaves no
    half file under a real name); it decides whether a stored page survives a
    power loss.
    """

    BATCH = "batch"  # one syncfs per put: one device flush for all its pages
    FILE = "file"  # fdatasync every file: portable, one flush per page
    NONE = "none"  # leave it to the kernel's writeback (~30 s)


@dataclass(frozen=True)
class DiskConfig:
    """One namespace's disk store."""

    root: Path
    namespace: bytes
    layout: PageLayout
    capacity_bytes: int
    io_threads: int = 16  # page reads/writes in flight: disks want a deep queue
    sync: SyncMode = SyncMode.BATCH
    direct_io: bool = True  # O_DIRECT when the layout and pool are aligned
    scan_wait_s: float = 0.5  # a start waits this long for the index; larger scans go on behind

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if self.capacity_bytes <= 0:
            raise ValueError(f"--disk-cache-gb must be positive, got {self.capacity_bytes} bytes")
        if self.io_threads <= 0:
            raise ValueError(f"--disk-io-threads must be positive, got {self.io_threads}")
        if not self.namespace:
            raise ValueError("the disk tier needs a non-empty namespace")
        object.__setattr__(self, "sync", SyncMode(self.sync))

    @property
    def folder(self) -> Path:
        return self.root / namespace_dir_name(self.namespace)


def check_pool(pool: np.ndarray, page_bytes: int, slots: Sequence[int]) -> None:
    """`pool` must be the L2 pool as `[slots, page_bytes]` uint8 and every slot in range."""
    if pool.dtype != np.uint8 or pool.ndim != 2 or pool.shape[1] != page_bytes:
        raise ValueError(f"pool must be uint8 [slots, {page_bytes}], got {pool.dtype} {pool.shape}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool must be C-contiguous")
    bad = [s for s in slots if not 0 <= s < pool.shape[0]]
    if bad:
        raise ValueError(f"slots out of range [0, {pool.shape[0]}): {bad[:8]}")


@dataclass(frozen=True)
class _Batch:
    """What the pages of one get/put share."""

    pool: np.ndarray  # [slots, page_bytes] uint8, the L2 pool
    stamp_ns: int  # LRU stamp of the chain's first page; later pages are older by 1 ns each
    direct: bool  # O_DIRECT possible for this pool and layout
    deadline: Deadline | None  # no page starts after it passed (or was cancelled)

    def late(self) -> bool:
        return passed(self.deadline)


class DiskBackend:
    """StorageBackend over a folder of page files (see the module docstring)."""

    def __init__(self, config: DiskConfig) -> None:
        self.config = config
        self.namespace = config.namespace
        self.layout = config.layout
        self.page_bytes = config.layout.page_bytes
        self._folder = config.folder
        make_private_dir(config.root)
        make_private_dir(self._folder)
        # The capacity is the whole folder's (every namespace); see storage.disk_folder.
        self._lease = NamespaceLease(self._folder)
        self._budget = FolderBudget(config.root, self._folder, config.capacity_bytes)
        self._index = PageIndex()
        self._stats = BackendStats(capacity_bytes=config.capacity_bytes)
        self._stats_lock = threading.Lock()
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="disk-io")
        self._scratch = Scratch()
        # Cleared for good when the filesystem refuses O_DIRECT (tmpfs, some FUSE).
        self._direct = config.direct_io
        self._closing = threading.Event()
        self._scan_done = threading.Event()
        self._scanner = threading.Thread(target=self._scan, name="disk-scan", daemon=True)
        self._scanner.start()
        self._scan_done.wait(config.scan_wait_s)

    # -- StorageBackend -------------------------------------------------

    def exists(self, hashes: Sequence[bytes]) -> int:
        return self._index.leading(hashes)

    def get(
        self,
        hashes: Sequence[bytes],
        slots: Sequence[int],
        pool: np.ndarray,
        deadline: Deadline | None = None,
    ) -> int:
        """Read pages into their slots; pages not started by `deadline` are misses.

        Returns only once no read into `pool` is in flight, even when one failed.
        """
        if len(hashes) != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots")
        check_pool(pool, self.page_bytes, slots)
        # Before the scan finished the index is partial: try the files anyway.
        n = len(hashes) if not self.ready else self._index.leading(hashes)
        batch = self._batch(pool, deadline)
        futures = [
            self._io.submit(self._read_one, h, s, batch)
            for h, s in zip(hashes[:n], slots[:n], strict=True)
        ]
        sizes = _results(futures)
        ok = sizes.index(0) if 0 in sizes else n
        self._index.add_chain(list(zip(hashes[:ok], sizes[:ok], strict=True)))
        self._restamp(hashes[:ok], batch.stamp_ns)
        self._count(
            hits=ok,
            misses=len(hashes) - ok,
            pages_read=ok,
            bytes_read=ok * self.page_bytes,
            direct_reads=ok if batch.direct and self._direct else 0,
        )
        return ok

    def put(
        self, pages: Sequence[PageRef], pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Write pages from `pool[page.slot]`; pages not started by `deadline` are not stored.

        The cache service passes private copies of the L2 slots (see `storage.tiered`).
        Returns only once no write from `pool` is in flight.
        """
        check_pool(pool, self.page_bytes, [p.slot for p in pages])
        age: dict[bytes, int] = {}  # position in the chain: 0 ends most recent
        for i, p in enumerate(pages):
            age.setdefault(p.page_hash, i)
        batch = self._batch(pool, deadline)
        todo = self._new_pages(pages)
        sizes = [self._file_size(len(p.tokens)) for p in todo]
        grant = self._index.reserve(sum(sizes), self._capacity(sum(sizes)))
        self._drop_victims(grant.victims)
        errors = self._write_all(todo, sizes, grant.nbytes, batch, age)
        lost = {h for h, _ in grant.victims} | {h for h, err in errors.items() if err is not None}
        new = {p.page_hash: size for p, size in zip(todo, sizes, strict=True)}
        size_of = {p.page_hash: self._file_size(len(p.tokens)) for p in pages}
        kept = [h for h in age if h not in lost]
        # Pages skipped as already indexed count only if no concurrent put evicted them.
        indexed = self._index.commit(grant.nbytes, [(h, size_of[h]) for h in kept], new)
        self._index.record_stamps((h, batch.stamp_ns - age[h]) for h in kept if h in new)
        self._restamp([h for h in kept if h not in new and h in indexed], batch.stamp_ns)
        self._count_writes(len(todo), [e for e in errors.values() if e is not None])
        return sum(p.page_hash in indexed for p in pages)

    def _capacity(self, needed: int) -> int:
        """This namespace's share of the folder's capacity, once `needed` more bytes come."""
        self._lease.try_acquire()
        own = self._index.bytes_used + self._index.bytes_reserved
        return self._budget.own_capacity(own, needed)

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

    def _batch(self, pool: np.ndarray, deadline: Deadline | None) -> _Batch:
        direct = self._direct and direct_possible(self.page_bytes, pool)
        return _Batch(pool, time.time_ns(), direct, deadline)

    def _write_all(
        self,
        todo: Sequence[PageRef],
        sizes: Sequence[int],
        budget: int,
        batch: _Batch,
        age: dict[bytes, int],
    ) -> dict[bytes, str | None]:
        """Write the pages that fit in `budget`; error text per page (None: stored).

        Three steps, so that a put costs one durability barrier, not one per page:
        temp files written in parallel, one sync (SyncMode.BATCH), then renames.
        """
        fits = _prefix_within(sizes, budget)
        futures = [
            self._io.submit(self._write_temp, p, batch, batch.stamp_ns - age[p.page_hash])
            for p in todo[:fits]
        ]
        temps = dict(zip((p.page_hash for p in todo[:fits]), _results(futures), strict=True))
        errors: dict[bytes, str | None] = {p.page_hash: "over capacity" for p in todo[fits:]}
        written = {h: t for h, t in temps.items() if isinstance(t, Path)}
        errors.update({h: t for h, t in temps.items() if isinstance(t, str)})
        barrier = self._sync_barrier() if written else None
        for h, tmp in written.items():
            if barrier is not None:  # not known to be durable: do not publish
                tmp.unlink(missing_ok=True)
            errors[h] = barrier or _publish(tmp, self._path(h))
        if batch.direct and self._direct:
            self._count(direct_writes=sum(e is None for e in errors.values()))
        return errors

    def _sync_barrier(self) -> str | None:
        if self.config.sync is not SyncMode.BATCH:
            return None
        try:
            syncfs(self._folder)
        except OSError as exc:
            return f"sync failed: {exc}"
        return None

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

    def delete(self, hashes: Sequence[bytes]) -> int:
        removed = 0
        for h in hashes:
            self._index.remove(h)
            removed += self._unlink(self._path(h))
        return removed

    def clear(self) -> int:
        """Remove every page file of this namespace, indexed or not; returns pages removed."""
        self._index.clear()
        removed = 0
        for sub in _subdirs(self._folder):
            for entry in os.scandir(sub):
                if parse_page_file_name(entry.name) is not None:
                    removed += self._unlink(Path(entry.path))
                elif entry.name.startswith(TMP_PREFIX):
                    self._unlink(Path(entry.path))
        return removed

    def stats(self) -> BackendStats:
        with self._stats_lock:
            snap = replace(self._stats, extra=dict(self._stats.extra))
        snap.pages = len(self._index)
        snap.bytes_used = self._index.bytes_used
        snap.extra["index_ready"] = float(self.ready)
        snap.extra["io_threads"] = float(self.config.io_threads)
        snap.extra["other_namespaces_bytes"] = float(self._budget.other_bytes)
        snap.extra["stale_namespace_evictions"] = float(self._budget.stale_evicted_pages)
        return snap

    def close(self) -> None:
        self._closing.set()
        self._scanner.join(timeout=5.0)
        self._io.shutdown(wait=True)
        self._lease.release()

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
        """Page hashes from the next eviction victim to the most recently used."""
        return self._index.lru_order()

    # -- internals ------------------------------------------------------

    def _path(self, page_hash: bytes) -> Path:
        name = page_file_name(page_hash)
        return self._folder / name[:2] / name

    def _file_size(self, n_tokens: int) -> int:
        return header_len_for(len(self.config.namespace), n_tokens, self.layout) + self.page_bytes

    def _new_pages(self, pages: Sequence[PageRef]) -> list[PageRef]:
        seen: set[bytes] = set()
        todo = []
        for p in pages:
            if p.page_hash not in self._index and p.page_hash not in seen:
                seen.add(p.page_hash)
                todo.append(p)
        return todo

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                if hasattr(self._stats, name):
                    setattr(self._stats, name, getattr(self._stats, name) + delta)
                else:
                    self._stats.extra[name] = self._stats.extra.get(name, 0.0) + delta

    def _unlink(self, path: Path) -> int:
        try:
            path.unlink()
            return 1
        except FileNotFoundError:
            return 0

    def _drop_victims(self, victims: Sequence[tuple[bytes, int]]) -> None:
        for h, _ in victims:
            self._unlink(self._path(h))
        if victims:
            self._count(evictions=len(victims))

    def _discard(self, page_hash: bytes, path: Path, reason: str) -> None:
        log.warning("disk page %s: %s; removing it", page_hash.hex(), reason)
        self._unlink(path)
        self._index.remove(page_hash)
        self._count(corrupt_detected=1)

    def _read_one(self, page_hash: bytes, slot: int, batch: _Batch) -> int:
        """Read and verify one page into its slot; its file size, or 0 on a miss."""
        if batch.late():
            self._count(late_skipped=1)
            return 0
        dst = memoryview(batch.pool[slot])
        path = self._path(page_hash)
        try:
            fd, direct = self._open_read(path, batch.direct)
        except FileNotFoundError:
            if self._index.remove(page_hash) is not None:
                self._count(corrupt_detected=1, vanished=1)
            return 0
        except OSError as exc:
            log.warning("disk page %s: cannot open: %s", page_hash.hex(), exc)
            self._count(read_errors=1)
            return 0
        try:
            result = self._read_verified(fd, page_hash, dst, direct)
        except OSError as exc:
            result = f"read failed: {exc}"
        finally:
            os.close(fd)
        if isinstance(result, str):
            self._discard(page_hash, path, result)
            return 0
        return result

    def _open_read(self, path: Path, direct: bool) -> tuple[int, bool]:
        """An open descriptor and whether it is O_DIRECT."""
        if direct and self._direct:
            try:
                return open_read(path, direct=True), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._no_direct(exc)
        return open_read(path, direct=False), False

    def _no_direct(self, exc: OSError) -> None:
        if self._direct:
            log.info("O_DIRECT refused under %s (%s); using buffered I/O", self._folder, exc)
        self._direct = False

    def _read_verified(self, fd: int, page_hash: bytes, dst: memoryview, direct: bool) -> int | str:
        """Read a file into `dst` and check everything; its size, or why it is bad."""
        head: bytearray | mmap.mmap
        if direct:
            # One aligned read of header block, payload and a probe for trailing bytes.
            head = self._scratch.head
            got = os.preadv(fd, [head, dst, self._scratch.tail], 0)
        else:
            head = bytearray(DIRECT_ALIGN)
            got = preadv_all(fd, [memoryview(head), dst, memoryview(bytearray(1))], 0)
        try:
            header_len = peek_header_len(head)
            if header_len != DIRECT_ALIGN:  # a long header: rare, read it plainly
                if direct:
                    clear_direct(fd)
                head = bytearray(header_len)
                got = preadv_all(fd, [memoryview(head), dst, memoryview(bytearray(1))], 0)
            header = decode_header(head)
        except HeaderError as exc:
            return f"bad header ({exc})"
        problem = self._header_problem(header, page_hash)
        if problem is not None:
            return problem
        if got != header_len + header.payload_len:
            return f"length {got} != {header_len + header.payload_len} (truncated or padded)"
        if payload_checksum(dst) != header.payload_checksum:
            return "payload checksum mismatch"
        return got

    def _header_problem(self, header: PageHeader, page_hash: bytes) -> str | None:
        if header.namespace != self.config.namespace:
            return "page of another namespace"
        if header.page_hash != page_hash:
            return "page hash does not match the file name"
        if header.layout != self.layout:
            return f"layout {header.layout} != {self.layout}"
        if header.payload_len != self.page_bytes:
            return f"payload length {header.payload_len} != {self.page_bytes}"
        return None

    def _write_temp(self, page: PageRef, batch: _Batch, stamp_ns: int) -> Path | str:
        """Write one page to a temp file in its final folder; the path, or the error text."""
        if batch.late():
            return "past the request's deadline"
        src = memoryview(batch.pool[page.slot])
        path = self._path(page.page_hash)
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
        header = encode_header(
            PageHeader(
                self.config.namespace,
                page.page_hash,
                page.tokens,
                self.layout,
                self.page_bytes,
                payload_checksum(src),
                page.parent,
            )
        )
        direct = batch.direct and self._direct and len(header) == DIRECT_ALIGN
        try:
            fd = self._create(tmp, direct)
        except OSError as exc:
            return str(exc)
        try:
            if direct:
                head = self._scratch.head
                head[:] = header
                pwritev_all(fd, [memoryview(head), src], 0)
            else:
                pwritev_all(fd, [memoryview(header), src], 0)
            set_mtime(fd, stamp_ns)
            if self.config.sync is SyncMode.FILE:
                os.fdatasync(fd)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            return str(exc)
        os.close(fd)
        return tmp

    def _create(self, path: Path, direct: bool) -> int:
        if direct:
            try:
                return create_private(path, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._no_direct(exc)
                path.unlink(missing_ok=True)
        return create_private(path, direct=False)

    def _scan(self) -> None:
        self._index.begin_scan()
        try:
            for sub in _subdirs(self._folder):
                if self._closing.is_set():
                    return
                self._index.add_scanned(self._scan_subdir(sub))
            self._index.end_scan()
            self._budget.refresh()
            self._drop_victims(self._index.reserve(0, self._capacity(0)).victims)
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

    def _scan_subdir(self, sub: Path) -> list[ScannedPage]:
        found = []
        for entry in os.scandir(sub):
            path = Path(entry.path)
            if entry.name.startswith(TMP_PREFIX):
                _remove_if_stale(path)
                continue
            page_hash = parse_page_file_name(entry.name)
            if page_hash is None:
                continue  # not ours: leave it alone
            result = self._check_file(path, page_hash)
            if isinstance(result, str):
                self._discard(page_hash, path, result)
            elif result is not None:
                found.append(result)
        return found

    def _check_file(self, path: Path, page_hash: bytes) -> ScannedPage | str | None:
        """Header-only check at start-up (payloads are verified when read)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, DIRECT_ALIGN, 0)
            header_len = peek_header_len(head)
            if header_len != DIRECT_ALIGN:
                head = os.pread(fd, header_len, 0)
            header = decode_header(head)
        except (HeaderError, OSError) as exc:
            return f"bad header ({exc})"
        finally:
            os.close(fd)
        problem = self._header_problem(header, page_hash)
        if problem is None and st.st_size != header_len + header.payload_len:
            problem = f"file size {st.st_size} != {header_len + header.payload_len}"
        return problem if problem else ScannedPage(page_hash, st.st_size, st.st_mtime_ns)


def _results(futures: Sequence[Future]) -> list:
    """Every future's result, after all of them finished: a job that fails must not
    return (and be answered) while its other pages are still being read or written."""
    wait(futures)
    return [f.result() for f in futures]


def _publish(tmp: Path, path: Path) -> str | None:
    """Give a complete temp file its real name (atomic); the error text, or None."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return str(exc)
    return None


def _prefix_within(sizes: Sequence[int], budget: int) -> int:
    total = 0
    for i, size in enumerate(sizes):
        total += size
        if total > budget:
            return i
    return len(sizes)


def _subdirs(folder: Path) -> list[Path]:
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    return sorted(Path(e.path) for e in entries if len(e.name) == 2 and e.is_dir())


def _remove_if_stale(path: Path) -> None:
    try:
        if time.time() - path.stat().st_mtime > STALE_TMP_S:
            path.unlink()
            log.info("removed stale temp file %s", path)
    except FileNotFoundError:
        pass
