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
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asynchicache.storage.liveness import pid_alive

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "asynchicache-"


def owner_pid(name: str) -> int | None:
    """The pid encoded in a segment name, or None when the name is not ours."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    parts = name[len(SEGMENT_PREFIX) :].split("-")
    return int(parts[0]) if parts and parts[0].isdigit() else None


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments whose owner process is gone; returns the names removed."""
    removed = []
    for path in shm_dir.glob(SEGMENT_PREFIX + "*"):
        pid = owner_pid(path.name)
        if pid is None or pid_alive(pid):
            continue
        try:
            path.unlink()
            removed.append(path.name)
            log.info("removed stale shared-memory segment %s (owner pid %d gone)", path.name, pid)
        except FileNotFoundError:
            pass
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
        path = shm_dir / name
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
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
