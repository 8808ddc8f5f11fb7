"""File I/O primitives for page files: vectored reads and writes straight between a
file and L2 shared memory, with O_DIRECT when everything is aligned.

O_DIRECT moves bytes by DMA between the disk and the L2 slot, skipping the
page-cache copy (a memcpy per page that costs a 2-core machine a third of its
CPU at disk speed) and a second RAM copy of data L2 already holds. It needs
the file offset, the length and the memory address of every buffer aligned to
`DIRECT_ALIGN`; a default-model page (737,280 bytes = 180 x 4096) and a 4096-byte
header qualify. Filesystems without O_DIRECT, or unaligned layouts, use the
buffered path with the same semantics.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DIRECT_ALIGN = 4096
# O_DIRECT is Linux-only; 0 elsewhere makes every "direct" open a plain one.
O_DIRECT = getattr(os, "O_DIRECT", 0)


class Scratch(threading.local):
    """Per-thread aligned blocks for O_DIRECT: a header block and a tail probe."""

    def __init__(self) -> None:
        self.head = mmap.mmap(-1, DIRECT_ALIGN)
        self.tail = mmap.mmap(-1, DIRECT_ALIGN)


def direct_possible(page_bytes: int, pool: np.ndarray) -> bool:
    """Whether every slot of `pool` is a valid O_DIRECT buffer."""
    return O_DIRECT != 0 and page_bytes % DIRECT_ALIGN == 0 and pool.ctypes.data % DIRECT_ALIGN == 0


def make_private_dir(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 (this user only), whatever the
    umask. A folder that exists keeps its mode: it may be someone's shared folder (a
    1777 /tmp lost its sticky bit to a chmod here once); whether an existing folder is
    private enough is the caller's check (storage.disk.folder.check_disk_folder)."""
    missing = []
    folder = path
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue  # another process made it meanwhile: not ours to chmod
        os.chmod(folder, 0o700)  # mkdir's mode went through the umask
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")


def private_dir_problem(folder: Path) -> str | None:
    """Why an existing `folder` is not a real folder of this user's that no one else may
    enter (None: it is). Checked without following a symlink, which passes every check
    made through it, then may point elsewhere."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"is not private (mode {stat.S_IMODE(st.st_mode):04o}, not 0700)"
    return None


def open_read(path: Path, direct: bool) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))


def create_private(path: Path, direct: bool) -> int:
    """Create a new file (mode 0600), making its folder (0700) when missing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        make_private_dir(path.parent)
        return os.open(path, flags, 0o600)


def write_private_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temp file, rename), mode 0600: a reader sees
    the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def clear_direct(fd: int) -> None:
    """Turn an O_DIRECT descriptor into a buffered one (for an unaligned remainder)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)


def preadv_all(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Fill `buffers` from `offset` until they are full or the file ends; bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            break
        total += n
        offset += n
        views = _advance(views, n)
    return total


def pwritev_all(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError("pwritev wrote nothing")
        total += n
        offset += n
        views = _advance(views, n)
    return total


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def set_mtime(target: int | Path, stamp_ns: int) -> None:
    """Best effort: a page file's mtime is its LRU stamp, which survives restarts."""
    with contextlib.suppress(OSError):
        os.utime(target, ns=(stamp_ns, stamp_ns))


def syncfs(folder: Path) -> None:
    """Flush the filesystem holding `folder` (data and metadata): one journal commit and
    one device cache flush for everything written before, where N fdatasyncs cost N
    flushes. Falls back to os.sync() where syncfs(2) is missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not hasattr(libc, "syncfs"):
            os.sync()
        elif libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")
    finally:
        os.close(fd)
