"""Helpers for the cache tests: tiny layout, token builders, an in-memory storage tier.

`MemoryStorage` (tests/support/storage_doubles.py) is the in-memory storage
tier, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from storage_doubles import MemoryStorage

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.keys import Namespace
from asynchicache.cache.pools import KVLayout

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("cache-test-model", "float32", PAGE)

__all__ = [
    "LAYOUT", "NS", "PAGE", "MakeCache", "MemoryStorage", "fill_page", "host_gb", "tokens_for",
]  # fmt: skip


def host_gb(slots: int, layout: KVLayout = LAYOUT) -> float:
    """`--host-cache-gb` that holds exactly `slots` pages of `layout`."""
    return slots * layout.page_bytes / 2**30


def tokens_for(*runs: int | Sequence[int]) -> list[int]:
    """Token list from page ids: page id k becomes PAGE tokens [k*100 + i]."""
    out: list[int] = []
    for run in runs:
        ids = [run] if isinstance(run, int) else list(run)
        for k in ids:
            out += [k * 100 + i for i in range(PAGE)]
    return out


def fill_page(cache: HiRadixCache, page: int, value: float) -> None:
    cache.device_pool.tensor[page].fill_(value)


MakeCache = Callable[..., HiRadixCache]
