"""One disk cache folder, many namespaces: leases and the folder-wide capacity.

    <root>/ns-<id>/.lease     held (shared flock) by every process serving that namespace
    <root>/ns-<id>/xx/*.kv    its pages (storage.disk)

`--disk-cache-gb` bounds the whole folder, every namespace in it. After an
upgrade (a new model, new numerics, a new KV layout) the old namespace's pages
are never read again; nobody leases that namespace any more, so its pages are
the first to go when a live namespace needs room, oldest first, before any
live page is evicted. An upgrade never strands gigabytes.

A namespace is in use while some process holds a shared `flock` on its lease
file; the kernel drops the lock when the process dies (even by SIGKILL), so a
crashed server leaves no stale "in use". An evictor takes the lock exclusively
(non-blocking) for the time it deletes a stale namespace's pages, so a server
starting on that namespace meanwhile waits a moment instead of losing pages it
is about to index. Lease files are never deleted while the folder is in
service: a process holding a lock on an unlinked file would look unused.

Live namespaces of other processes are counted (their folders' sizes, scanned
at most every `refresh_s`) but not evicted: each live store evicts its own
least recently used pages, so the folder converges to its capacity, shared
first come, first served. Give servers that must not compete their own folders.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LEASE_NAME = ".lease"
NS_PREFIX = "ns-"
PAGE_SUFFIX = ".kv"


class NamespaceLease:
    """A shared lock on a namespace folder's lease file: "a live server uses these pages"."""

    def __init__(self, folder: Path, wait_s: float = 5.0) -> None:
        self.folder = folder
        self._fd: int | None = None
        self._unsupported = False  # the filesystem has no flock: lease nothing, evict nothing
        deadline = time.monotonic() + wait_s
        while not self.try_acquire() and time.monotonic() < deadline:
            time.sleep(0.05)  # an evictor holds it exclusively for a moment
        if not self.held and not self._unsupported:
            log.warning("lease on %s not taken yet (held by an evictor); retrying on use", folder)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the shared lock if not held yet (never blocks); whether it is held now."""
        if self._fd is not None or self._unsupported:
            return self._fd is not None
        fd = os.open(self.folder / LEASE_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                # No flock here (some network or FUSE filesystems): this namespace looks
                # unused to others, who may evict its pages (a counted miss, never wrong).
                log.warning("no flock on %s (%s): namespace lease off", self.folder, exc)
                self._unsupported = True
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


@contextlib.contextmanager
def exclusive(folder: Path, create: bool = True) -> Iterator[bool]:
    """Hold `folder`'s lease exclusively if nobody uses the namespace; yields whether we do.

    Without `create`, a folder with no lease file (nobody ever leased it) counts as free.
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(folder / LEASE_NAME, flags, 0o600)
    except FileNotFoundError:
        yield not create
        return
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False  # a live server holds it
            return
        yield True
    finally:
        os.close(fd)


def in_use(folder: Path) -> bool:
    """Whether a live process leases this namespace folder."""
    with exclusive(folder, create=False) as free:
        return not free


def namespace_folders(root: Path) -> list[Path]:
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    return sorted(Path(e.path) for e in entries if e.name.startswith(NS_PREFIX) and e.is_dir())


@dataclass(frozen=True)
class _PageFile:
    mtime_ns: int
    size: int
    path: Path


@dataclass
class _Other:
    """Another namespace folder as last scanned."""

    folder: Path
    live: bool
    bytes: int = 0
    pages: deque[_PageFile] = field(default_factory=deque)  # stale ones only, oldest first


class FolderBudget:
    """How much of the folder's capacity one namespace's store may use, right now.

    `own_capacity` is what the store passes to its index as its capacity: the
    folder's capacity less what other namespaces hold, after deleting pages of
    namespaces nobody leases for the room the store needs.
    """

    def __init__(self, root: Path, own_folder: Path, capacity: int, refresh_s: float = 30.0):
        self.root = root
        self.own_folder = own_folder
        self.capacity = capacity
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._others: list[_Other] = []
        self._scanned_at: float | None = None
        self.stale_evicted_pages = 0
        self.stale_evicted_bytes = 0

    @property
    def other_bytes(self) -> int:
        with self._lock:
            return sum(o.bytes for o in self._others)

    def refresh(self) -> None:
        """Re-scan the other namespace folders (sizes; stale pages in age order)."""
        with self._lock:
            self._scan()

    def own_capacity(self, own_bytes: int, needed: int) -> int:
        """Room for this namespace, having evicted stale namespaces' pages for `needed` more."""
        with self._lock:
            if self._scanned_at is None or time.monotonic() - self._scanned_at > self.refresh_s:
                self._scan()
            excess = own_bytes + needed + sum(o.bytes for o in self._others) - self.capacity
            if excess > 0:
                self._evict_stale(excess)
            return max(0, self.capacity - sum(o.bytes for o in self._others))

    def _scan(self) -> None:
        others = []
        for folder in namespace_folders(self.root):
            if folder == self.own_folder:
                continue
            live = in_use(folder)
            pages = _page_files(folder)
            other = _Other(folder, live, sum(p.size for p in pages))
            if not live:
                other.pages = deque(sorted(pages, key=lambda p: p.mtime_ns))
            others.append(other)
        self._others = others
        self._scanned_at = time.monotonic()

    def _evict_stale(self, excess: int) -> None:
        """Delete pages of unleased namespaces (oldest first) until `excess` bytes are freed."""
        stale = [o for o in self._others if not o.live and o.pages]
        freed = 0
        for other in sorted(stale, key=lambda o: o.pages[0].mtime_ns):
            if freed >= excess:
                break
            with exclusive(other.folder) as free:
                if not free:
                    other.live = True  # a server started on it since the scan
                    continue
                freed += self._delete_oldest(other, excess - freed)
        if freed:
            log.info("disk: freed %.1f MB of unused namespaces' pages", freed / 1e6)

    def _delete_oldest(self, other: _Other, target: int) -> int:
        freed = 0
        while other.pages and freed < target:
            page = other.pages.popleft()
            with contextlib.suppress(FileNotFoundError):
                page.path.unlink()
                self.stale_evicted_pages += 1
                self.stale_evicted_bytes += page.size
            freed += page.size  # gone either way: someone else removed it
            other.bytes -= page.size
        return freed


def _page_files(folder: Path) -> list[_PageFile]:
    out = []
    for sub in _scandir(folder):
        if len(sub.name) != 2 or not sub.is_dir():
            continue
        for entry in _scandir(Path(sub.path)):
            if not entry.name.endswith(PAGE_SUFFIX) or entry.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat()
                out.append(_PageFile(st.st_mtime_ns, st.st_size, Path(entry.path)))
    return out


def _scandir(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []  # removed meanwhile (a clear, another evictor)
