"""Writing page files: temp file, one durability barrier per put, atomic rename.

A put writes its temp files (`.tmp-*` in the page's final folder) in
parallel, then makes them durable with one `syncfs` (SyncMode.BATCH: one
device flush for the batch; an fdatasync per file costs a flush per page, a
third of the write bandwidth here), then renames them: a crash never leaves
half a file under a real name.

With --cache-encrypt a page's file holds its AES-GCM ciphertext, written from
this I/O thread's aligned scratch buffer instead of the slot
(storage.header.seal_page, storage.page_cipher).

`PageWriter` also owns the O_DIRECT decision for its folder: the first open
a filesystem refuses with EINVAL (tmpfs, some FUSE) switches reads and writes
to buffered I/O for good.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asynchicache.common.fileio import (
    DIRECT_ALIGN,
    Scratch,
    create_private,
    open_read,
    pwritev_all,
    set_mtime,
    syncfs,
)
from asynchicache.settings.config import SyncMode
from asynchicache.storage.base import PageRef
from asynchicache.storage.disk.names import TMP_PREFIX
from asynchicache.storage.disk.page_file import PageFiles
from asynchicache.storage.header import PageHeader, seal_page

if TYPE_CHECKING:
    from asynchicache.storage.disk.disk_config import DiskConfig, IoBatch

log = logging.getLogger(__name__)


def prefix_within(sizes: Sequence[int], budget: int) -> int:
    """How many leading `sizes` fit in `budget`."""
    total = 0
    for i, size in enumerate(sizes):
        total += size
        if total > budget:
            return i
    return len(sizes)


class PageWriter:
    """Temp files, the barrier and the renames of one namespace folder's puts."""

    def __init__(
        self,
        files: PageFiles,
        config: DiskConfig,
        scratch: Scratch,
        path_of: Callable[[bytes], Path],
        count: Callable[..., None],
    ) -> None:
        self.files = files
        self.config = config
        self.folder = config.folder
        self.direct = config.direct_io  # cleared for good when the filesystem refuses it
        self._scratch = scratch
        self._path_of = path_of
        self._count = count

    def write_temp(self, page: PageRef, batch: IoBatch, stamp_ns: int) -> Path | str:
        """Write one page to a temp file in its final folder; the path, or the error text."""
        if batch.late():
            return "past the request's deadline"
        src = memoryview(batch.pool[page.slot])
        path = self._path_of(page.page_hash)
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
        # body: `src` itself, or its ciphertext in this thread's scratch (--cache-encrypt)
        header, body = seal_page(
            PageHeader(
                self.files.namespace,
                page.page_hash,
                page.tokens,
                self.files.layout,
                self.files.layout.page_bytes,
                b"",  # the checksum: filled by seal_page
                page.parent,
            ),
            self.files.keys,
            src,
        )
        direct = batch.direct and self.direct and len(header) == DIRECT_ALIGN
        try:
            fd = self._create(tmp, direct)
        except OSError as exc:
            return str(exc)
        try:
            if direct:
                head = self._scratch.head
                head[:] = header
                pwritev_all(fd, [memoryview(head), body], 0)
            else:
                pwritev_all(fd, [memoryview(header), body], 0)
            set_mtime(fd, stamp_ns)
            if self.config.disk_sync is SyncMode.FILE:
                os.fdatasync(fd)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            return str(exc)
        os.close(fd)
        return tmp

    def publish(self, temps: dict[bytes, Path | str], direct: bool) -> dict[bytes, str | None]:
        """Make the written temp files durable (one barrier), then give them their names;
        error text per page (None: stored)."""
        errors: dict[bytes, str | None] = {h: t for h, t in temps.items() if isinstance(t, str)}
        written = {h: t for h, t in temps.items() if isinstance(t, Path)}
        barrier = self._sync_barrier() if written else None
        for h, tmp in written.items():
            if barrier is not None:  # not known to be durable: do not publish
                tmp.unlink(missing_ok=True)
            errors[h] = barrier or _rename(tmp, self._path_of(h))
        if direct and self.direct:
            self._count(direct_writes=sum(errors[h] is None for h in written))
        return errors

    def open_read(self, path: Path, direct: bool) -> tuple[int, bool]:
        """An open descriptor and whether it is O_DIRECT."""
        if direct and self.direct:
            try:
                return open_read(path, direct=True), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._no_direct(exc)
        return open_read(path, direct=False), False

    def _sync_barrier(self) -> str | None:
        if self.config.disk_sync is not SyncMode.BATCH:
            return None
        try:
            syncfs(self.folder)
        except OSError as exc:
            return f"sync failed: {exc}"
        return None

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

    def _no_direct(self, exc: OSError) -> None:
        if self.direct:
            log.info("O_DIRECT refused under %s (%s); using buffered I/O", self.folder, exc)
        self.direct = False


def _rename(tmp: Path, path: Path) -> str | None:
    """Give a complete temp file its real name (atomic); the error text, or None."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return str(exc)
    return None
