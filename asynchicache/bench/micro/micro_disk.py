"""Disk tier micro-benchmark: our backend against `dd` on the same folder, in the same run.

    python -m asynchicache.bench.micro.micro_disk [--total-mb 768] [--repeats 3] [--bench-dir DIR]

Pages are shaped like the default model's (30 layers x 2 x 16 tokens x 3 KV
heads x 64 x float32 = 737,280 bytes) and move between a real shared-memory
pool and the real `DiskBackend`:

* `disk_write_GBps`: `put` of every page (`--sync batch`, the default: each
  put's files are made durable by one syncfs before their rename, so the data
  is on disk when `put` returns; `--sync file` fdatasyncs every file);
* `disk_read_cold_GBps`: `get` of every page into other slots, verified, after
  dropping the files from the page cache;
* `dd_write_GBps` / `dd_read_cold_GBps`: `dd bs=1M conv=fsync` of as many bytes,
  and `dd` reading it back after dropping its cache.

`--disk-encrypt` runs our side with `--cache-encrypt` (a fresh key; every page
AES-256-GCM encrypted on write, decrypted and its tag checked on read,
storage.page_cipher): the ratios to dd then say what encryption costs against
the disk's bound.

Each repeat measures dd, ours, ours, dd (writes, then cold reads) back to back,
so the ratios compare the same disk conditions (this disk's speed drifts a lot
within a minute). `measure(args)` returns the numbers as a dict (for the
`bench micro` report); `main()` prints them as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from asynchicache.bench.micro import micro_pages
from asynchicache.bench.micro.micro_pages import DEFAULT_LAYOUT
from asynchicache.settings.config import SyncMode
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.page_keys import PageKeys

_NAMESPACE = b"bench-micro-disk\x1ffloat32\x1f16\x1f1\x1f"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--total-mb", type=int, default=768, help="bytes moved per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bench-dir", type=Path, default=None, help="default: under /var/tmp")
    parser.add_argument("--io-threads", type=int, default=16)
    parser.add_argument("--batch-pages", type=int, default=64, help="pages per put/get call")
    parser.add_argument("--no-direct-io", action="store_true", help="buffered I/O in the backend")
    parser.add_argument("--dd-direct", action="store_true", help="dd reads with iflag=direct")
    parser.add_argument("--sync", choices=[m.value for m in SyncMode], default="batch")
    parser.add_argument(
        "--disk-encrypt", action="store_true", help="pages encrypted (--cache-encrypt)"
    )


@dataclass(frozen=True)
class DiskBenchOptions:
    """The section's knobs; missing attributes of a caller's args take these defaults."""

    total_mb: int = 768
    repeats: int = 3
    bench_dir: Path | None = None
    io_threads: int = 16
    batch_pages: int = 64
    no_direct_io: bool = False
    dd_direct: bool = False
    sync: str = "batch"
    disk_encrypt: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace | DiskBenchOptions) -> DiskBenchOptions:
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})


def drop_cache(paths: Sequence[Path]) -> str:
    """Evict `paths` from the page cache; says how (fadvise always, drop_caches as root)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "posix_fadvise(DONTNEED) per file"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        method += " + /proc/sys/vm/drop_caches=3"
    except OSError:
        pass
    return method


def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - t0


def _dd_write(target: Path, total: int) -> float:
    count = total // micro_pages.MB
    return _dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fsync"])


def _dd_read(target: Path, direct: bool) -> float:
    return _dd([f"if={target}", "of=/dev/null", "bs=1M", *(["iflag=direct"] if direct else [])])


def _one_round(folder: Path, pool: np.ndarray, pages: int, opts: DiskBenchOptions) -> dict:
    """dd, ours, ours, dd (writes, then cold reads): drift in the disk's speed cancels out.

    Nothing is deleted until every round is done: deleting gigabytes makes this
    disk (mounted with `discard`) slow for a while, which would hit whoever
    comes next.
    """
    total = pages * DEFAULT_LAYOUT.page_bytes
    cfg = DiskConfig(
        folder / "kv",
        _NAMESPACE,
        DEFAULT_LAYOUT,
        disk_cache_bytes=1 << 50,
        io_threads=opts.io_threads,
        disk_sync=SyncMode(opts.sync),
        direct_io=not opts.no_direct_io,
        keys=PageKeys((os.urandom(32).hex().encode(),), True) if opts.disk_encrypt else None,
    )
    disk = DiskBackend(cfg)
    try:
        sets = [[os.urandom(16) for _ in range(pages)] for _ in range(2)]
        dd_files = [folder / "dd-a.bin", folder / "dd-b.bin"]
        step = opts.batch_pages
        w = [_dd_write(dd_files[0], total)]
        w += [micro_pages.put_all(disk, pool, hashes, step) for hashes in sets]
        w.append(_dd_write(dd_files[1], total))
        method = drop_cache([*dd_files, *(disk.path_of(h) for hs in sets for h in hs)])
        r = [_dd_read(dd_files[0], opts.dd_direct)]
        r += [micro_pages.get_all(disk, pool, hashes, step) for hashes in sets]
        r.append(_dd_read(dd_files[1], opts.dd_direct))
        direct = disk.stats().extra.get("direct_reads", 0) == 2 * pages
    finally:
        disk.close()
    # Each side moved 2 x total bytes: its rate is bytes over its summed seconds.
    ours_w, dd_w = 2 * total / (w[1] + w[2]) / 1e9, 2 * total / (w[0] + w[3]) / 1e9
    ours_r, dd_r = 2 * total / (r[1] + r[2]) / 1e9, 2 * total / (r[0] + r[3]) / 1e9
    return {
        "disk_write_GBps": ours_w,
        "disk_read_cold_GBps": ours_r,
        "dd_write_GBps": dd_w,
        "dd_read_cold_GBps": dd_r,
        "write_ratio": ours_w / dd_w,
        "read_ratio": ours_r / dd_r,
        "_method": method,
        "_direct": direct,
    }


def measure(args: argparse.Namespace | DiskBenchOptions) -> dict:
    """Run the disk section; GB/s are 1e9 bytes per second, medians over the repeats."""
    opts = DiskBenchOptions.from_args(args)
    pages = micro_pages.pages_for(opts.total_mb)
    owned = opts.bench_dir is None
    if opts.bench_dir is None:
        folder = Path(tempfile.mkdtemp(prefix="asynchicache-bench-", dir="/var/tmp"))
    else:
        folder = opts.bench_dir
        folder.mkdir(parents=True, exist_ok=True)
    rounds = [folder / f"round-{i}" for i in range(opts.repeats)]
    try:
        with micro_pages.bench_pool(pages) as pool:
            runs = [_one_round(r, pool, pages, opts) for r in rounds]
    finally:
        for r in rounds:
            shutil.rmtree(r, ignore_errors=True)
        if owned:
            shutil.rmtree(folder, ignore_errors=True)
    keys = [k for k in runs[0] if not k.startswith("_")]
    medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    return {
        **medians,
        "runs": [{k: round(r[k], 3) for k in keys} for r in runs],
        "cold_read_method": runs[0]["_method"],
        "backend_io": ("O_DIRECT" if runs[0]["_direct"] else "buffered")
        + f", {opts.io_threads} threads, sync={opts.sync}, {opts.batch_pages} pages per put/get"
        + (", AES-256-GCM encrypted (--cache-encrypt)" if opts.disk_encrypt else ""),
        "dd": "bs=1M conv=fsync; read bs=1M" + (" iflag=direct" if opts.dd_direct else ""),
        "order": "per round: dd, ours, ours, dd writes; drop caches; the same order for reads;"
        " files deleted only after the last round",
        "pages": pages,
        "page_bytes": DEFAULT_LAYOUT.page_bytes,
        "total_MB": round(pages * DEFAULT_LAYOUT.page_bytes / 1e6, 1),
        "folder": str(folder),
    }


def main(argv: list[str] | None = None) -> int:
    return micro_pages.section_main("micro_disk", "disk tier vs dd", add_arguments, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
