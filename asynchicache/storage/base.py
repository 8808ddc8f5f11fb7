"""The storage interfaces: what a backend (disk, Redis) does, and what the cache sees.

Two levels:

* `StorageBackend` is synchronous and lives in the cache service process (or
  its thread). It moves whole pages between its medium and slots of the L2
  shared-memory pool, without extra copies.
* `StorageTier` is the asynchronous, engine-side view (implemented by
  `storage.client.storage_client.StorageClient`): the hierarchy submits loads and stores as
  tickets and learns of their completion through a non-blocking `poll()`.

Page identity is the chained page hash of `cache.keys` (16 bytes). Only full
pages are stored. A page is stored with its token ids so that files and values
are self-describing and verifiable.

Also here, what every backend shares: `check_read` / `check_pool` (the L2 pool
and slots a call names, checked before any byte moves) and `StatsCounter` (its
`BackendStats`, counted into from several threads).

This module imports no backend: the cache layer imports it without loading
redis-py or ZeroMQ (tests/storage/test_storage_base.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from asynchicache.common.deadline import Deadline

# A chain's page hashes (16 bytes each, in chain order) and the L2 slots their pages
# move through, `slots[i]` for `hashes[i]`.
Hashes = Sequence[bytes]
Slots = Sequence[int]

# Bytes per element of the dtypes a KV page may hold, by torch/numpy name
# (numpy has no bfloat16 or float8, so the size cannot come from np.dtype).
_ITEMSIZE = MappingProxyType(
    {
        "float64": 8,
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "int8": 1,
        "uint8": 1,
    }
)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of `dtype`; raises ValueError naming the known dtypes."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {sorted(_ITEMSIZE)}")
    return size


@dataclass(frozen=True)
class PageLayout:
    """What one page's bytes are: dtype and shape `[layers, 2, page_size, kv_heads, head_dim]`.

    Stored in every file header and checked on read, so a cache written by a
    different model layout is a miss, never misread bytes.
    """

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dtype_itemsize(self.dtype)
        if not self.shape or any(not isinstance(d, int) or d <= 0 for d in self.shape):
            raise ValueError(f"page shape must be positive ints, got {self.shape}")

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def page_bytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PageRef:
    """One page to store: its chained hash, its tokens, and the L2 slot holding its bytes.

    `parent` is the hash the page's hash was chained from (the previous page's
    hash, or the namespace digest for page 0), so a stored page names its
    predecessor and an audit can rebuild whole chains from a folder. Empty
    when unknown (tools that store pages outside any chain).
    """

    page_hash: bytes
    tokens: tuple[int, ...]
    slot: int
    parent: bytes = b""


@dataclass(frozen=True)
class TierStats:
    """What `StorageTier.stats` reports: each tier's counters (None: that tier is off)
    and the service's own (requests, queue depths, by name)."""

    disk: BackendStats | None = None
    service: dict[str, float] = field(default_factory=dict)
    remote: BackendStats | None = None
    at: float = 0.0  # CLOCK_MONOTONIC when they arrived (shared by this host's processes)


@dataclass
class BackendStats:
    """Counters every backend keeps (also exported as metrics); see `StatsCounter`."""

    pages: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    pages_read: int = 0
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt_detected: int = 0
    evictions: int = 0
    store_failures: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClearScope:
    """Which stored pages of a namespace a clear removes.

    `root` limits it to the chains that start from that h_0 (a `cache_salt`'s:
    `Namespace.with_salt(salt).digest()`; see storage.lineage); b"" means every
    page. Pinned pages stay unless `include_pinned`, which also drops the pins
    (of that root only, when one is given).
    """

    root: bytes = b""
    include_pinned: bool = False


@dataclass(frozen=True)
class Cleared:
    """What a clear did in one tier: pages removed, pinned pages kept, or why it could not."""

    removed: int = 0
    pinned_kept: int = 0
    error: str | None = None


class StorageBackend(Protocol):
    """A synchronous page store (`DiskBackend`, `RedisBackend`, and `TieredBackend` chaining
    them). `pool` is the L2 pool as `[slots, page_bytes]` uint8 (`check_pool`).

    A call stops starting pages once `deadline` has passed (or was cancelled): those pages
    count as missed (read) or not stored (write). When it returns, nothing of it touches
    `pool` any more. Clearing is each tier's own (`clear`, with that tier's arguments).
    """

    def exists(self, hashes: Hashes) -> int:
        """How many pages of the chain `hashes` are present, counting from the start."""
        ...

    def get(
        self, hashes: Hashes, slots: Slots, pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Read pages into `pool[slots[i]]`; returns how many leading pages were verified."""
        ...

    def put(
        self, pages: Sequence[PageRef], pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Write pages from `pool[page.slot]`; returns how many were stored."""
        ...

    def delete(self, hashes: Hashes) -> int: ...

    def stats(self) -> BackendStats: ...

    def close(self) -> None: ...


def check_pool(pool: np.ndarray, page_bytes: int, slots: Slots) -> None:
    """`pool` must be the L2 pool as `[slots, page_bytes]` uint8 and every slot in range."""
    if pool.dtype != np.uint8 or pool.ndim != 2 or pool.shape[1] != page_bytes:
        raise ValueError(f"pool must be uint8 [slots, {page_bytes}], got {pool.dtype} {pool.shape}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool must be C-contiguous")
    bad = [s for s in slots if not 0 <= s < pool.shape[0]]
    if bad:
        raise ValueError(f"slots out of range [0, {pool.shape[0]}): {bad[:8]}")


def check_read(hashes: Hashes, slots: Slots, pool: np.ndarray, page_bytes: int) -> None:
    """A `get`'s arguments: one slot per hash, each in `pool` (see `check_pool`)."""
    if len(hashes) != len(slots):
        raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots")
    check_pool(pool, page_bytes, slots)


class StatsCounter:
    """A backend's `BackendStats`, added to by its I/O threads and read as snapshots."""

    def __init__(self, stats: BackendStats | None = None) -> None:
        self._stats = stats or BackendStats()
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Add to a named field when it has one, else to `extra`."""
        with self._lock:
            for name, delta in deltas.items():
                if hasattr(self._stats, name):
                    setattr(self._stats, name, getattr(self._stats, name) + delta)
                else:
                    self._stats.extra[name] = self._stats.extra.get(name, 0.0) + delta

    def snapshot(self) -> BackendStats:
        """A copy the caller may change (backends add their gauges to it)."""
        with self._lock:
            return replace(self._stats, extra=dict(self._stats.extra))


class TicketKind(StrEnum):
    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True)
class Completion:
    """A finished storage ticket, as `StorageTier.poll()` reports it.

    For a load, `pages_ok` is the number of leading pages that were read into
    their L2 slots and verified; the rest must be recomputed. For a store it is
    the number of pages persisted. `error` explains a failure (timeout, service
    down, corrupt page) and is None on full success. `pages_from_remote` is how
    many of a load's `pages_ok` came from the remote tier (L4) rather than disk.
    `settled` is False when the service may still touch the ticket's L2 slots
    (see `Settled`): the caller keeps them quarantined until then.
    """

    ticket: int
    kind: TicketKind
    pages_ok: int
    pages_requested: int
    error: str | None = None
    pages_from_remote: int = 0
    settled: bool = True


@dataclass(frozen=True)
class Settled:
    """The service will touch the L2 slots of `ticket` no more.

    A `Completion` with `settled=False` (the client gave up on the ticket, e.g.
    a timeout, while the service may still read into or write from its slots)
    is followed, once, by a `Settled` for the same ticket: when the late reply
    arrives, when the service acknowledges a cancel of work it never started,
    or when the service process is gone. Until then the slots are quarantined:
    never freed, never reused. `reason` says which signal it was.
    """

    ticket: int
    reason: str


@runtime_checkable
class TierLookup(Protocol):
    """A storage tier that tells its disk and remote parts apart (`StorageClient`)."""

    def exists_by_tier(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(leading pages on disk, the pages right after those in the remote tier)."""
        ...


class StorageTier(Protocol):
    """The hierarchy's asynchronous view of L3/L4. Nothing here may block for I/O."""

    def exists(self, hashes: Hashes) -> int:
        """Leading pages available below L2 (index lookup, bounded time; 0 when unreachable)."""
        ...

    def submit_load(self, hashes: Hashes, slots: Slots) -> int:
        """Start reading pages into L2 `slots`; returns a ticket id at once."""
        ...

    def submit_store(self, pages: Sequence[PageRef]) -> int:
        """Start writing pages from their L2 slots; the slots must stay untouched until done."""
        ...

    def cancel(self, ticket: int) -> None: ...

    def register_pool(self, namespace: bytes, segment: str, layout: PageLayout) -> None:
        """Name the L2 pool our slot numbers index (`Namespace.encode()`, the shared-memory
        segment's name, one page's layout); the engine calls it once its pool exists."""
        ...

    def stats(self, timeout_s: float = 1.0) -> TierStats | None:
        """The tiers' and the service's counters; None when no answer came in `timeout_s`
        (a short request on the admin path, never the scheduler's)."""
        ...

    def stats_snapshot(self, max_age_s: float = 1.0) -> TierStats | None:
        """The latest counters the service sent, without waiting: when they are older than
        `max_age_s`, fresher ones are asked for and arrive with a later `poll()`. None
        before the first answer. What the engine's thread may call (admin, /metrics)."""
        ...

    def poll(self) -> list[Completion | Settled]:
        """Tickets finished (and unsettled tickets settled) since the last call. Never blocks.

        Every submitted ticket yields exactly one `Completion`; one whose
        `settled` is False later yields exactly one `Settled`.
        """
        ...

    def close(self) -> None: ...
