"""KV page pools: the page layout, a page allocator, the L1 device pool and the L2 host pool.

One page-first layout serves both tiers,
`[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`, so a page is one
contiguous block across all layers and an L1<->L2 move is one copy per run of pages.

The L2 pool lives in a named shared-memory segment so the cache service process
can map the same bytes (`HostPool.attach`) and move pages to disk or Redis
without a copy through a socket.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from asynchicache.storage.shm import SharedSegment

log = logging.getLogger(__name__)


class PoolExhausted(RuntimeError):
    """Raised by `PageAllocator.allocate` when fewer pages are free than asked for."""


class DoubleFree(ValueError):
    """Raised when a page that is already free (or out of range) is freed."""


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one KV page; the same in every tier."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        # [layers, 2 (k, v), page_size, kv_heads, head_dim]
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_numel(self) -> int:
        return math.prod(self.page_shape)

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.dtype.itemsize

    def pages_in(self, num_bytes: float) -> int:
        """How many whole pages fit in `num_bytes`."""
        return int(num_bytes) // self.page_bytes


class PageAllocator:
    """A free list of page indices `0 .. num_pages - 1`.

    Allocation hands out the lowest free pages first, so pools stay compact and
    a request's pages tend to form runs (one copy per run instead of per page).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        self._num_total = num_pages
        # Kept sorted in descending order (lazily), so the lowest pages pop off the end.
        self._free = list(range(num_pages - 1, -1, -1))
        self._sorted = True
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        if not self._sorted:
            self._free.sort(reverse=True)
            self._sorted = True
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; raises DoubleFree (and changes nothing) on a free or unknown page."""
        pages = list(pages)
        is_free = self._is_free
        for p in pages:
            if not 0 <= p < self._num_total:
                raise DoubleFree(f"page {p} is outside the pool of {self._num_total}")
            if is_free[p]:
                raise DoubleFree(f"page {p} freed twice")
        if len(set(pages)) != len(pages):
            raise DoubleFree(f"the same page appears twice in {pages}")
        for p in pages:
            is_free[p] = 1
        self._free.extend(pages)
        self._sorted = False

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> list[int]:
        return list(self._free)


class DevicePool:
    """L1: the KV pages the model reads, as one tensor on the engine's device."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.device = torch.device(device)
        # [pages, layers, 2, page_size, kv_heads, head_dim]
        self.tensor = torch.zeros(
            (num_pages, *layout.page_shape), dtype=layout.dtype, device=self.device
        )
        self.allocator = PageAllocator(num_pages)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_total

    def layer(self, layer: int) -> torch.Tensor:
        """A strided view of one layer: [pages, 2, page_size, kv_heads, head_dim]."""
        return self.tensor[:, layer]


class HostPool:
    """L2: KV pages in a named shared-memory segment, mapped zero-copy.

    The creating process owns the segment (and its allocator) and unlinks it on
    `close()`; other processes `attach` by name and only unmap on close.
    """

    def __init__(
        self, layout: KVLayout, segment: SharedSegment, num_slots: int, pinned: bool = False
    ) -> None:
        self.layout = layout
        self.segment = segment
        self.num_slots = num_slots
        raw = segment.as_array()[: num_slots * layout.page_bytes]
        # [slots, page_bytes]: the view storage backends read and write.
        self.slots: np.ndarray | None = raw.reshape(num_slots, layout.page_bytes)
        # [slots, layers, 2, page_size, kv_heads, head_dim], sharing memory with `slots`.
        self.tensor: torch.Tensor | None = torch.from_numpy(raw).view(layout.dtype).view(
            num_slots, *layout.page_shape
        )
        self.allocator = PageAllocator(num_slots) if segment.owner else None
        self._pinned = pinned and self._pin()

    @classmethod
    def create(
        cls, layout: KVLayout, num_slots: int, pin_memory: bool = False, tag: str = "l2"
    ) -> HostPool:
        if num_slots <= 0:
            raise ValueError(f"the host pool needs at least one slot, got {num_slots}")
        segment = SharedSegment.create(num_slots * layout.page_bytes, tag=tag)
        return cls(layout, segment, num_slots, pinned=pin_memory)

    @classmethod
    def attach(cls, name: str, layout: KVLayout) -> HostPool:
        """Map an existing pool by its segment name (another process's `HostPool.name`)."""
        segment = SharedSegment.attach(name)
        if segment.size % layout.page_bytes:
            segment.close()
            raise ValueError(
                f"segment {name} holds {segment.size} bytes, not a whole number of "
                f"{layout.page_bytes}-byte pages: wrong layout?"
            )
        return cls(layout, segment, segment.size // layout.page_bytes)

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def pinned(self) -> bool:
        return self._pinned

    def _pin(self) -> bool:
        """Page-lock the segment for the GPU so host<->device copies can run async."""
        if not torch.cuda.is_available() or self.tensor is None:
            return False
        nbytes = self.num_slots * self.layout.page_bytes
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of %d bytes failed (%s); copies stay sync", nbytes, err)
            return False
        return True

    def close(self) -> None:
        """Unmap (owner: also unlink). Views handed out earlier keep the mapping until dropped."""
        if self.tensor is None:
            return
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.tensor = None
        self.slots = None
        self.segment.close()
