"""POSIX shared-memory segments that any process can map by name.

We map `/dev/shm/<name>` with `mmap` ourselves instead of using
`multiprocessing.shared_memory`: on CPython 3.11 an *attached* SharedMemory is
registered with the resource tracker, which unlinks the segment when the
attaching process exits and so destroys the owner's pool.

The owner reserves the whole segment in tmpfs when it creates it, in a
background thread (`posix_fallocate`): a page first touched by a read from
disk into a fresh slot otherwise costs a page fault and zeroing inside that
read (a restart's 2,048-token load from disk, SmolLM2: 159 ms median without
the reservation, 137 ms with it, 5 interleaved pairs on a quiet machine), and a segment
larger than what /dev/shm can hold fails at creation with a clear message
instead of killing a process with SIGBUS on first touch, hours later.

Segment names carry the owner's pid (`asynchicache-<pid>-<token>`), so a
segment left by a crashed owner can be recognised and removed on the next start.

/dev/shm is writable by every local user, so nothing found there is trusted:
the stale scan reads only names it can parse into a real pid and removes only
plain files this user owns (a foreign name, folder, symlink or another user's
file is left alone, never an error); `attach` takes only a segment name (no
path), opens it with `O_NOFOLLOW` (a planted symlink cannot redirect the
mapping to another file) and refuses a segment owned by another user (it could
read or change our KV through it).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asynchicache.common.liveness import pid_alive

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "asynchicache-"
_PID_MAX = 1 << 22  # Linux's largest pid_max (PID_MAX_LIMIT); above it `kill` overflows
_NAME_MAX = 255


def owner_pid(name: str) -> int | None:
    """The pid encoded in a segment name, or None when the name is not ours."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    digits = name[len(SEGMENT_PREFIX) :].split("-")[0]
    # ASCII digits only (int() also reads other scripts' digits), and a pid `kill` can take.
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 7:
        return None
    pid = int(digits)
    return pid if 0 < pid <= _PID_MAX else None


def check_segment_name(name: str) -> None:
    """A segment name of ours, not a path (ValueError otherwise)."""
    if not name.startswith(SEGMENT_PREFIX) or len(name) > _NAME_MAX or "/" in name or "\0" in name:
        raise ValueError(f"bad segment name {name!r}: expected {SEGMENT_PREFIX}<pid>-<tag>")


def _removable(path: Path) -> bool:
    """A plain file of this user (never follows a symlink)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments whose owner process is gone; returns the names removed.

    Anything else that matches the prefix (any user can create such names) is skipped."""
    removed = []
    for path in shm_dir.glob(SEGMENT_PREFIX + "*"):
        pid = owner_pid(path.name)
        if pid is None or pid_alive(pid) or not _removable(path):
            continue
        try:
            path.unlink()
        except OSError as exc:  # gone meanwhile, or not ours after all
            log.debug("cannot remove shared-memory segment %s: %s", path.name, exc)
            continue
        removed.append(path.name)
        log.info("removed stale shared-memory segment %s (owner pid %d gone)", path.name, pid)
    return removed


def _check_room(shm_dir: Path, size: int) -> None:
    fs = os.statvfs(shm_dir)
    free = fs.f_bavail * fs.f_frsize
    if size > free:
        raise OSError(
            errno.ENOSPC,
            f"a {size / 2**30:.2f} GiB shared-memory pool does not fit in {shm_dir} "
            f"({free / 2**30:.2f} GiB free): lower the host cache size",
        )


def _reserve(fd: int, size: int, name: str) -> None:
    """Allocate the segment's pages now (off the caller's thread; the kernel does the work)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:  # another process filled /dev/shm since the check
        log.warning("cannot reserve shared-memory segment %s (%d bytes): %s", name, size, exc)
    finally:
        os.close(fd)


def list_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    return sorted(p.name for p in shm_dir.glob(SEGMENT_PREFIX + "*"))


@dataclass
class SharedSegment:
    """A named, fixed-size shared-memory mapping.

    The creator owns the segment (unlinks it on `close(unlink=True)`); any other
    process attaches with `SharedSegment.attach(name)` and only unmaps on close.
    """

    name: str
    size: int
    owner: bool
    _mmap: mmap.mmap

    @classmethod
    def create(cls, size: int, tag: str = "pool", shm_dir: Path = SHM_DIR) -> SharedSegment:
        if size <= 0:
            raise ValueError(f"shared segment size must be positive, got {size}")
        remove_stale_segments(shm_dir)
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(4)}"
        path = shm_dir / name
        _check_room(shm_dir, size)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        threading.Thread(
            target=_reserve, args=(fd, size, name), name="shm-reserve", daemon=True
        ).start()
        return cls(name=name, size=size, owner=True, _mmap=mapped)

    @classmethod
    def attach(cls, name: str, shm_dir: Path = SHM_DIR) -> SharedSegment:
        """Map another process's segment: ours by name, a plain file, owned by this user."""
        check_segment_name(name)
        fd = os.open(shm_dir / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionError(
                    f"shared-memory segment {name} is owned by uid {st.st_uid}, not by this "
                    f"user ({os.geteuid()}), or is not a plain file: refusing to map it"
                )
            size = st.st_size
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name=name, size=size, owner=False, _mmap=mapped)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._mmap)

    def as_array(self) -> np.ndarray:
        """A zero-copy uint8 view of the whole segment."""
        return np.frombuffer(self._mmap, dtype=np.uint8)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Views made from the segment must be dropped first."""
        try:
            self._mmap.close()
        except BufferError:
            # A numpy/torch view is still alive; the mapping goes when it does.
            log.debug("segment %s still has live views; leaving the mapping to GC", self.name)
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
