"""A folder's cold sequential read bandwidth, as `dd` measures it.

An L3 hit's time is judged against what the disk under the cache folder can
deliver: a file of the hit's size is written into the same folder, made
durable, dropped from the page cache (`posix_fadvise(DONTNEED)`), and read by
`dd` with 4 MiB blocks. Two readings: with `iflag=direct` (O_DIRECT: the
device's pace, what the cache service's direct reads can reach; skipped where
the filesystem refuses it) and buffered (through the page cache, with the
kernel's readahead). The bandwidth is dd's own: bytes over the seconds it reports.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

MIN_BYTES = 16 << 20  # smaller reads time the first request's latency, not the disk
BLOCK = "4M"
_SECONDS = re.compile(r"copied, ([0-9.eE+-]+) s")


@dataclass(frozen=True)
class ColdRead:
    """dd's cold reads of one file: bytes, and GB/s (1e9 bytes) with and without O_DIRECT."""

    num_bytes: int
    direct_GBps: float | None  # None: O_DIRECT refused by the filesystem
    buffered_GBps: float

    @property
    def GBps(self) -> float:
        """The disk's pace: the direct reading where there is one."""
        return self.direct_GBps if self.direct_GBps is not None else self.buffered_GBps

    def report(self) -> dict[str, float | int | str]:
        return {
            "dd_read_cold_GBps": round(self.GBps, 4),
            "dd_read_mode": "direct" if self.direct_GBps is not None else "buffered",
            "dd_read_cold_buffered_GBps": round(self.buffered_GBps, 4),
            "dd_read_bytes": self.num_bytes,
        }


def _write(path: Path, num_bytes: int) -> None:
    """Random bytes (nothing a filesystem could compress or leave sparse), made durable."""
    chunk = os.urandom(1 << 20)
    with path.open("wb") as f:
        left = num_bytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_GBps(path: Path, direct: bool) -> float | None:
    """One dd read of `path`: GB/s, or None when dd failed (O_DIRECT refused)."""
    flags = ["iflag=direct"] if direct else []
    args = ["dd", f"if={path}", "of=/dev/null", f"bs={BLOCK}", *flags]
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    match = _SECONDS.search(done.stderr)
    if done.returncode != 0 or match is None or float(match.group(1)) <= 0:
        return None
    return path.stat().st_size / float(match.group(1)) / 1e9


def cold_read(folder: Path, num_bytes: int) -> ColdRead:
    """Write `num_bytes` (at least `MIN_BYTES`) into `folder`, read them back cold with dd."""
    size = max(num_bytes, MIN_BYTES)
    fd, name = tempfile.mkstemp(prefix=".dd-", dir=folder)
    os.close(fd)
    path = Path(name)
    try:
        _write(path, size)
        drop_cached(path)
        direct = dd_GBps(path, direct=True)
        drop_cached(path)
        buffered = dd_GBps(path, direct=False)
        if buffered is None:
            raise RuntimeError(f"dd could not read {path}")
        return ColdRead(size, direct, buffered)
    finally:
        path.unlink(missing_ok=True)
