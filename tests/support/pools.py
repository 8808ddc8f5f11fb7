"""L2-like pools for the storage and remote tests: real shared memory, small page layouts."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np

from asynchicache.common.keys import chain_hashes
from asynchicache.common.shm import SharedSegment
from asynchicache.storage.base import PageLayout, PageRef

# 1 KiB pages take the buffered path (and are enough for logic); 8 KiB pages are
# 4096-aligned and use O_DIRECT on disk.
SMALL = PageLayout("float32", (2, 2, 4, 2, 8))
ALIGNED = PageLayout("float32", (2, 2, 16, 2, 16))
# The default model's page: 30 layers x 2 x 16 tokens x 3 kv heads x 64 x 4 bytes = 737,280.
DEFAULT = PageLayout("float32", (30, 2, 16, 3, 64))
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


def pool_factory() -> Iterator[Callable[..., Pool]]:
    """Yields `make(slots, layout=SMALL, fill=0, seed=0)`: a pool whose first `fill` slots
    hold random pages; every pool it made is closed (and unlinked) after."""
    pools: list[Pool] = []

    def make(slots: int, layout: PageLayout = SMALL, fill: int = 0, seed: int = 0) -> Pool:
        pools.append(Pool(slots, layout))
        if fill:
            pools[-1].fill(range(fill), seed)
        return pools[-1]

    yield make
    for p in pools:
        p.close()


def new_hashes(n: int) -> list[bytes]:
    """`n` distinct 16-byte page names (the tiers treat hashes as opaque names)."""
    return [os.urandom(16) for _ in range(n)]


def refs(hashes: list[bytes], slots: list[int] | range, page_tokens: int = 4) -> list[PageRef]:
    """Pages with distinct token ids (stored in every value's header)."""
    return [
        PageRef(h, tuple(range(i * page_tokens, (i + 1) * page_tokens)), s)
        for i, (h, s) in enumerate(zip(hashes, slots, strict=True))
    ]


def chain(
    root: bytes, first: int, pages: int, slot0: int = 0, page: int = SMALL.shape[2]
) -> list[PageRef]:
    """A real chain of `page`-token pages from `root` (hashes chained as the engine chains
    them), tokens `first`.., in slots `slot0`.."""
    tokens = list(range(first, first + pages * page))
    hashes = chain_hashes(root, tokens, page)
    parents = [root, *hashes[:-1]]
    return [
        PageRef(h, tuple(tokens[i * page : (i + 1) * page]), slot0 + i, parents[i])
        for i, h in enumerate(hashes)
    ]
