"""Helpers for the storage tests: small page layouts and real shared-memory pools."""

from __future__ import annotations

import os

import numpy as np

from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.shm import SharedSegment

# 1 KiB pages take the buffered path; 8 KiB pages are 4096-aligned and use O_DIRECT.
SMALL = PageLayout("float32", (2, 2, 4, 2, 8))
ALIGNED = PageLayout("float32", (2, 2, 16, 2, 16))
NAMESPACE = b"test-model\x1ffloat32\x1f4\x1f1\x1f"


class Pool:
    """An L2-like pool: a real shared-memory segment viewed as `[slots, page_bytes]`."""

    def __init__(self, slots: int, layout: PageLayout) -> None:
        self.layout = layout
        self.segment = SharedSegment.create(slots * layout.page_bytes, tag="test")
        self.array = self.segment.as_array().reshape(slots, layout.page_bytes)

    def fill(self, slots: range | list[int], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        for s in slots:
            self.array[s] = rng.integers(0, 256, self.layout.page_bytes, dtype=np.uint8)

    def close(self) -> None:
        del self.array
        self.segment.close()


def new_hashes(n: int) -> list[bytes]:
    """`n` distinct 16-byte page names (the disk tier treats hashes as opaque names)."""
    return [os.urandom(16) for _ in range(n)]


def refs(hashes: list[bytes], slots: list[int] | range) -> list[PageRef]:
    return [
        PageRef(h, tuple(range(i, i + 4)), s)
        for i, (h, s) in enumerate(zip(hashes, slots, strict=True))
    ]
