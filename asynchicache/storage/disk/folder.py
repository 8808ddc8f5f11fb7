"""One disk cache folder, many namespaces: leases and the folder-wide capacity.

    <root>/ns-<id>/.lease     held (shared flock) by every process serving that namespace
    <root>/ns-<id>/xx/*.kv    its pages (storage.disk.backend)

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

The folder's usage is kept in one ledger (storage.disk.folder_ledger); a writer
that needs room evicts, in this order: pages of namespaces nobody leases
(`FolderBudget.evict_stale`, oldest first), its own least recently used pages
(storage.disk.space), and, last, pages of its own namespace that another live
service wrote and this one never indexed (`evict_unindexed`, oldest file
first). Live namespaces of other processes are never evicted: they shrink by
their own writers' evictions. Pinned pages (storage.disk.pins) are never evicted by
anyone. Give servers that must not compete their own folders.

Whoever can write in the folder can plant page files that every server on it
serves (a right checksum over wrong KV): `check_disk_folder` refuses a folder
that belongs to another user or that group or others may write, a sticky one
too (1777: the sticky bit stops others deleting our files, not adding theirs).
A folder asynchicache makes is 0700; one that exists keeps its mode.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from asynchicache.storage.disk.disk_pins import PINS_DIR, load_pins
from asynchicache.storage.disk.names import (
    PAGE_SUFFIX,
    namespace_folders,
    page_subdirs,
    parse_page_file_name,
    scandir,
    unlink_size,
)

log = logging.getLogger(__name__)

LEASE_NAME = ".lease"


class UnsafeFolderError(ValueError):
    """A disk cache folder others could write into (or that is not a folder of ours)."""


def check_disk_folder(root: Path, flag: str = "--disk-cache-dir") -> None:
    """Refuse `root` (when it exists) unless it is this user's own folder that no one
    else may write; the message says why and what to do. A missing folder passes: it
    will be made 0700."""
    try:
        st = root.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(f"{flag} {root} is not a folder")
    if st.st_uid != os.getuid():
        raise UnsafeFolderError(
            f"{flag} {root} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
            "whoever owns it can plant pages this server would serve; use a folder of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                           if mode & bit)  # fmt: skip
        raise UnsafeFolderError(
            f"{flag} {root} is writable by {who} (mode {mode:04o}): anyone who can write there "
            f"can plant pages this server would serve. Use a folder of your own (a new path "
            f"is made 0700), or run: chmod go-w {root}"
        )


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


@dataclass(frozen=True)
class _PageFile:
    mtime_ns: int
    size: int
    path: Path
    page_hash: bytes


@dataclass
class _Other:
    """Another namespace folder as last scanned."""

    folder: Path
    live: bool
    bytes: int = 0
    pages: deque[_PageFile] = field(default_factory=deque)  # stale ones only, oldest first


class FolderBudget:
    """The other namespaces of a folder: their sizes, and the stale ones' pages to evict."""

    def __init__(self, root: Path, own_folder: Path, refresh_s: float = 30.0):
        self.root = root
        self.own_folder = own_folder
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

    def evict_stale(self, excess: int) -> int:
        """Delete unpinned pages of unleased namespaces, oldest first, until `excess` bytes
        are freed (or none is left); the bytes freed."""
        with self._lock:
            if self._scanned_at is None or time.monotonic() - self._scanned_at > self.refresh_s:
                self._scan()
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
            return freed

    def _scan(self) -> None:
        others = []
        for folder in namespace_folders(self.root):
            if folder == self.own_folder:
                continue
            live = in_use(folder)
            pages = page_files(folder)
            other = _Other(folder, live, sum(p.size for p in pages))
            if not live:
                pinned = {h for pin in load_pins(folder / PINS_DIR, time.time()) for h in pin.pages}
                evictable = [p for p in pages if p.page_hash not in pinned]
                other.pages = deque(sorted(evictable, key=lambda p: p.mtime_ns))
            others.append(other)
        self._others = others
        self._scanned_at = time.monotonic()

    def _delete_oldest(self, other: _Other, target: int) -> int:
        freed = 0
        while other.pages and freed < target:
            page = other.pages.popleft()
            got = unlink_size(page.path, page.size)
            if got:
                self.stale_evicted_pages += 1
                self.stale_evicted_bytes += got
            freed += got
            other.bytes -= page.size  # gone either way: someone else removed it
        return freed


def page_files(folder: Path) -> list[_PageFile]:
    """Every page file of a namespace folder with its stamp (mtime) and size."""
    out = []
    for sub in page_subdirs(folder):
        for entry in scandir(sub):
            page_hash = parse_page_file_name(entry.name)
            if page_hash is None or not entry.name.endswith(PAGE_SUFFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat()
                out.append(_PageFile(st.st_mtime_ns, st.st_size, Path(entry.path), page_hash))
    return out


def evict_unindexed(
    folder: Path, known: Container[bytes], pinned: Container[bytes], target: int
) -> tuple[int, int]:
    """Delete page files of `folder` that are neither `known` (indexed here) nor pinned,
    oldest first, until `target` bytes are freed; (bytes freed, files deleted).

    These are pages another live service on the same folder wrote: evicting
    them is the last resort of a writer whose own pages do not make room.
    """
    candidates = [p for p in page_files(folder) if p.page_hash not in known]
    freed = deleted = 0
    for page in sorted(candidates, key=lambda p: p.mtime_ns):
        if freed >= target:
            break
        if page.page_hash in pinned:
            continue
        got = unlink_size(page.path, page.size)
        freed += got
        deleted += got > 0
    return freed, deleted
