"""One capacity per disk cache folder, shared by every process writing it.

    <root>/.lock    flock'ed exclusively while a process reserves room or evicts
    <root>/.usage   "<bytes> <unix time of the last full count>": every page and
                    temp file of every namespace, plus room reserved for writes
                    in flight

Several services (one machine, or several over a network file system) may
write one folder; each sees only its own index, so none can tell the folder's
size from what it knows. The ledger is what they agree on: a writer takes the
lock, reads the usage, evicts until its pages fit under `--disk-cache-gb`,
adds what it reserves, writes the usage back and lets go; the writes happen
after, outside the lock. Whoever removes a page file subtracts its size, and
only the process whose `unlink` succeeded does (storage.disk.names.unlink_size),
so a page two evictors race for is subtracted once.

Drift (a writer killed between reserving and writing, files removed by hand)
is corrected by a full count under the lock: when the ledger is missing or
unreadable, at a service's start, and when the last count is older than
`recount_s`. The count adds up page files and temp files; a reservation whose
temp file does not exist yet is missed by a count, which errs on the small
side by at most the writes in flight at that moment.

On a filesystem without flock the lock is a no-op (logged once): the ledger
still bounds each writer, but two racing writers may overshoot by one put.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from asynchicache.common.fileio import write_private_text
from asynchicache.storage.disk.names import (
    PAGE_SUFFIX,
    TMP_PREFIX,
    namespace_folders,
    page_subdirs,
    scandir,
)

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
USAGE_NAME = ".usage"
RECOUNT_S = 300.0


@dataclass
class Usage:
    """The folder's usage while the lock is held; change `bytes`, it is written back."""

    bytes: int
    counted_at: float

    def add(self, delta: int) -> None:
        self.bytes = max(0, self.bytes + delta)


def count_folder(root: Path) -> int:
    """Bytes of every page and temp file under `root` (all namespaces)."""
    total = 0
    for ns in namespace_folders(root):
        total += _sizes(ns, lambda name: name.startswith(TMP_PREFIX))
        for sub in page_subdirs(ns):
            total += _sizes(sub, lambda n: n.endswith(PAGE_SUFFIX) or n.startswith(TMP_PREFIX))
    return total


def _sizes(folder: Path, wanted: Callable[[str], bool]) -> int:
    total = 0
    for entry in scandir(folder):
        if wanted(entry.name):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


class FolderLedger:
    """The usage file of one folder and the lock that serializes its writers."""

    def __init__(self, root: Path, recount_s: float = RECOUNT_S) -> None:
        self.root = root
        self.recount_s = recount_s
        self._mutex = threading.Lock()  # flock is per open file: threads need their own lock
        self._fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._flock = True
        self._force_count = False
        self.recounts = 0

    @contextlib.contextmanager
    def locked(self) -> Iterator[Usage]:
        """Hold the folder's lock; yields its usage, written back when changed."""
        with self._mutex:
            self._lock()
            try:
                usage = self._read()
                before = (usage.bytes, usage.counted_at)
                yield usage
                if (usage.bytes, usage.counted_at) != before:
                    self._write(usage)
            finally:
                self._unlock()

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` (files removed, room reserved and not used)."""
        if nbytes:
            with self.locked() as usage:
                usage.add(-nbytes)

    def recount(self) -> int:
        """Count the folder now (under the lock); the usage."""
        self._force_count = True
        with self.locked() as usage:
            return usage.bytes

    def peek(self) -> int:
        """The usage as last written (no lock; for stats)."""
        parsed = _parse(_read_text(self.root / USAGE_NAME))
        return parsed.bytes if parsed is not None else 0

    def close(self) -> None:
        with self._mutex:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _read(self) -> Usage:
        usage = _parse(_read_text(self.root / USAGE_NAME))
        stale = usage is None or time.time() - usage.counted_at > self.recount_s
        if stale or self._force_count:
            self._force_count = False
            self.recounts += 1
            return Usage(count_folder(self.root), time.time())
        assert usage is not None
        return usage

    def _write(self, usage: Usage) -> None:
        # Atomic: a reader without the lock (peek) never sees half a line.
        write_private_text(self.root / USAGE_NAME, f"{usage.bytes} {usage.counted_at:.3f}\n")

    def _lock(self) -> None:
        if not self._flock:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log.warning("no flock under %s (%s): the folder's writers are not serialized",
                        self.root, exc)  # fmt: skip
            self._flock = False

    def _unlock(self) -> None:
        if self._flock:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


def _parse(text: str) -> Usage | None:
    parts = text.split()
    try:
        used, counted = int(parts[0]), float(parts[1])
    except (IndexError, ValueError):
        return None
    return Usage(used, counted) if used >= 0 else None
