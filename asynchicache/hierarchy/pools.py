"""KV page pools: the page layout, the L1 device pool and the L2 host pool.

One page-first layout serves both tiers,
`[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`, so a page is one
contiguous block across all layers and an L1<->L2 move is one copy per run of pages.
Pools are memory only: which page is free or in use is the cache's page ledger
(`cache.ledger`), the one record of every page's state.

The L2 pool lives in a named shared-memory segment so the cache service process
can map the same bytes (`HostPool.attach`) and move pages to disk or Redis
without a copy through a socket.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from asynchicache.common.shm import SharedSegment
from asynchicache.settings.config import CacheConfig

log = logging.getLogger(__name__)


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


class DevicePool:
    """L1: the KV pages the model reads, as one tensor on the engine's device."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.device = torch.device(device)
        # [pages, layers, 2, page_size, kv_heads, head_dim]
        self.tensor = torch.zeros(
            (num_pages, *layout.page_shape), dtype=layout.dtype, device=self.device
        )

    @property
    def num_pages(self) -> int:
        return self.tensor.shape[0]

    def layer(self, layer: int) -> torch.Tensor:
        """A strided view of one layer: [pages, 2, page_size, kv_heads, head_dim]."""
        return self.tensor[:, layer]


class HostPool:
    """L2: KV pages in a named shared-memory segment, mapped zero-copy.

    The creating process owns the segment and unlinks it on
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
        self.tensor: torch.Tensor | None = (
            torch.from_numpy(raw).view(layout.dtype).view(num_slots, *layout.page_shape)
        )
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


def cache_host_pool(
    config: CacheConfig, layout: KVLayout, device: torch.device, given: HostPool | None
) -> HostPool | None:
    """The L2 pool of a cache: `given` (owned, same layout), else one of --host-cache-gb
    (None when the host tier is disabled)."""
    if given is not None:
        if given.layout != layout or not given.segment.owner:
            raise ValueError("host_pool must be an owned HostPool with the cache's layout")
        return given
    if not config.host_enabled:
        return None
    slots = layout.pages_in(config.host_cache_gb * 2**30)
    if slots <= 0:
        raise ValueError(
            f"--host-cache-gb {config.host_cache_gb} holds no page of {layout.page_bytes} bytes"
        )
    return HostPool.create(layout, slots, pin_memory=device.type == "cuda")
