"""Helpers for the cache tests: tiny layout, token builders, an in-memory storage tier.

`MemoryStorage` is a test helper satisfying the `StorageTier` protocol. Like
the real service it reads and writes L2 slots itself, and it does so only when
`poll()` completes the ticket, so a cache that touched a slot under I/O would
corrupt what is stored or loaded and fail the byte checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.keys import Namespace
from asynchicache.cache.pools import HostPool, KVLayout
from asynchicache.storage.base import Completion, PageRef, TicketKind

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
NS = Namespace("cache-test-model", "float32", PAGE)


@dataclass
class _Op:
    ticket: int
    kind: TicketKind
    hashes: list[bytes]
    slots: list[int]
    pages: list[PageRef]


class MemoryStorage:
    """An in-memory L3 for tests: pages by hash, moved in `poll()`."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.pages: dict[bytes, bytes] = {}
        self.ops: list[_Op] = []
        self.hold = False  # when True, nothing completes
        self.load_limit: int | None = None  # deliver at most this many pages per load
        self.next_ticket = 100
        self.stores = 0
        self.loads = 0

    def exists(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.pages:
                break
            n += 1
        return n

    def submit_load(self, hashes: Sequence[bytes], slots: Sequence[int]) -> int:
        return self._queue(TicketKind.LOAD, list(hashes), list(slots), [])

    def submit_store(self, pages: Sequence[PageRef]) -> int:
        return self._queue(TicketKind.STORE, [], [], list(pages))

    def _queue(self, kind: TicketKind, hashes: list[bytes], slots: list[int], pages: list) -> int:
        self.next_ticket += 1
        self.ops.append(_Op(self.next_ticket, kind, hashes, slots, pages))
        return self.next_ticket

    def cancel(self, ticket: int) -> None:
        self.ops = [op for op in self.ops if op.ticket != ticket]

    def poll(self) -> list[Completion]:
        if self.hold:
            return []
        done, self.ops = self.ops, []
        return [self._run(op) for op in done]

    def _run(self, op: _Op) -> Completion:
        slots = self.pool.slots
        assert slots is not None
        if op.kind == TicketKind.STORE:
            for ref in op.pages:
                self.pages[ref.page_hash] = slots[ref.slot].tobytes()
            self.stores += len(op.pages)
            return Completion(op.ticket, op.kind, len(op.pages), len(op.pages))
        n = self.exists(op.hashes)
        if self.load_limit is not None:
            n = min(n, self.load_limit)
        for h, s in zip(op.hashes[:n], op.slots[:n], strict=True):
            slots[s] = np.frombuffer(self.pages[h], dtype=np.uint8)
        self.loads += n
        error = None if n == len(op.hashes) else f"only {n} pages"
        return Completion(op.ticket, op.kind, n, len(op.hashes), error)

    def close(self) -> None:
        pass


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
