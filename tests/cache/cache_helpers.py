"""Helpers for the cache tests: tiny layout, token builders, an in-memory storage tier.

`MemoryStorage` (tests/support/storage_doubles.py) is the in-memory storage
tier, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from storage_doubles import MemoryStorage

from asynchicache.common.keys import Namespace
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.jobs import LoadTicket
from asynchicache.hierarchy.pools import KVLayout
from asynchicache.hierarchy.results import LockedPages, MatchResult

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("cache-test-model", "float32", PAGE)

__all__ = [
    "LAYOUT", "NS", "PAGE", "MakeCache", "MemoryStorage", "device_values", "fill_page",
    "finish", "host_gb", "load_now", "only_in_storage", "put", "release", "storage_of",
    "tokens_for",
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


def put(
    cache: HiRadixCache,
    tokens: list[int],
    value: float = 1.0,
    *,
    salt: str = "",
    keep_lock: bool = False,
    store: bool = True,
) -> LockedPages:
    """Allocate pages, write page i = value + i into them, insert as a finished request
    would (unlocked unless `keep_lock`), and check the cache."""
    pages = cache.allocate(len(tokens) // PAGE)
    assert pages is not None
    for i, p in enumerate(pages):
        fill_page(cache, p, value + i)
    result = cache.insert(tokens, pages, salt=salt, store=store)
    if not keep_lock:
        cache.unlock(result.handle)
    cache.check_integrity()
    return result


def only_in_storage(cache: HiRadixCache, tokens: list[int], value: float = 1.0) -> None:
    """`put` `tokens`, let their stores land, then clear L1 and L2: storage alone holds them."""
    put(cache, tokens, value)
    cache.drain()
    cache.clear()
    assert cache.lookup(tokens) == {"device": 0, "host": 0, "disk": len(tokens), "remote": 0}


def release(cache: HiRadixCache, ticket: LoadTicket) -> None:
    """Unlock the L1 prefix a collected load holds for its caller."""
    assert ticket.handle is not None
    cache.unlock(ticket.handle)


def storage_of(cache: HiRadixCache) -> MemoryStorage:
    """The cache's in-memory storage tier (a cache made `with_storage`)."""
    assert isinstance(cache.storage, MemoryStorage)
    return cache.storage


MakeCache = Callable[..., HiRadixCache]


def device_values(cache: HiRadixCache, pages: list[int]) -> list[float]:
    """The value each L1 page of `pages` is filled with (each page holds one value)."""
    out = []
    for p in pages:
        page = cache.device_pool.tensor[p]
        assert page.eq(page.flatten()[0]).all()
        out.append(float(page.flatten()[0]))
    return out


def finish(cache: HiRadixCache, ticket: LoadTicket) -> LoadTicket:
    """Wait until `poll` collected `ticket` (every copy and storage operation done)."""
    done = cache.drain()
    assert ticket in done and ticket.done
    cache.check_integrity()
    return ticket


def load_now(cache: HiRadixCache, match: MatchResult) -> LoadTicket:
    """Start the load of `match` and wait until `poll` collected it."""
    ticket = cache.load(match)
    assert ticket is not None
    return finish(cache, ticket)
