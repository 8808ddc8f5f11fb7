"""A namespace's disk store: its configuration, and what the pages of one read or write share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asynchicache.common.deadline import Deadline, passed
from asynchicache.settings.config import (
    CacheConfig,
    ServiceTuning,
    SyncMode,
    check_disk_cache_bytes,
    check_max_pinned_fraction,
)
from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.names import namespace_dir_name
from asynchicache.storage.header import header_len_for
from asynchicache.storage.page_keys import PageKeys


@dataclass(frozen=True)
class DiskConfig:
    """One namespace's disk store."""

    disk_cache_dir: Path  # the folder (--disk-cache-dir); this namespace is a subfolder
    namespace: bytes
    layout: PageLayout
    disk_cache_bytes: int  # the whole folder's, every namespace in it (--disk-cache-gb)
    io_threads: int = ServiceTuning.io_threads  # page I/O in flight: disks want a deep queue
    disk_sync: SyncMode = ServiceTuning.disk_sync
    direct_io: bool = True  # O_DIRECT when the layout and pool are aligned
    scan_wait_s: float = 0.5  # a start waits this long for the index; larger scans go on behind
    max_pinned_fraction: float = CacheConfig.max_pinned_fraction  # of disk_cache_bytes
    keys: PageKeys | None = None  # --cache-key-file: pages carry a keyed MAC (page_keys.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "disk_cache_dir", Path(self.disk_cache_dir))
        check_disk_cache_bytes(self.disk_cache_bytes)
        if self.io_threads <= 0:
            raise ValueError(f"--io-threads must be positive, got {self.io_threads}")
        if not self.namespace:
            raise ValueError("the disk tier needs a non-empty namespace")
        check_max_pinned_fraction(self.max_pinned_fraction)
        object.__setattr__(self, "disk_sync", SyncMode(self.disk_sync))

    @property
    def folder(self) -> Path:
        return self.disk_cache_dir / namespace_dir_name(self.namespace)

    @property
    def page_file_bytes(self) -> int:
        """Bytes of one page's file (header + payload): what the capacity counts."""
        tokens = self.layout.shape[2]  # [layers, 2, page_size, kv_heads, head_dim]
        return header_len_for(len(self.namespace), tokens, self.layout) + self.layout.page_bytes


@dataclass(frozen=True)
class IoBatch:
    """What the pages of one get/put share."""

    pool: np.ndarray  # [slots, page_bytes] uint8, the L2 pool
    stamp_ns: int  # LRU stamp of the chain's first page; later pages are older by 1 ns each
    direct: bool  # O_DIRECT possible for this pool and layout
    deadline: Deadline | None  # no page starts after it passed (or was cancelled)

    def late(self) -> bool:
        return passed(self.deadline)
