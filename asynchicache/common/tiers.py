"""The four tiers a page can be in, and the events of pages entering and leaving them.

One vocabulary for every layer: the cache's tree (device, host), the cache
service (disk, remote), the engine's KV event publisher, the admin routes, the
metrics and the benchmark all name tiers with `Tier` and report changes with
the three events below, named after vLLM's (our block is a page, its hash the
chained page hash of DESIGN.md). They stay inside our processes: what leaves
for routers is vLLM's own wire format, one medium per tier (kv_events/wire.py,
which the publisher turns these into).

A page may be in several tiers at once. `block_size`: the cache service does
not know the page size, so its events leave it None.

This module imports nothing of asynchicache, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, get_args


class Tier(StrEnum):
    """Where a page is: L1 to L4. A value is also the tier's name on every wire and route."""

    DEVICE = "device"  # L1: the engine's KV pool
    HOST = "host"  # L2: pinned host memory
    DISK = "disk"  # L3: the cache service's page files
    REMOTE = "remote"  # L4: Redis/Valkey


# The names as a type, for request schemas and signatures (checked against `Tier` below).
TierName = Literal["device", "host", "disk", "remote"]
TIERS: tuple[str, ...] = tuple(t.value for t in Tier)  # L1 to L4, in order
STORAGE_TIERS: tuple[str, ...] = (Tier.DISK.value, Tier.REMOTE.value)  # the cache service's
if get_args(TierName) != TIERS:  # one vocabulary: the type cannot drift from the enum
    raise ImportError(f"TierName {get_args(TierName)} differs from Tier {TIERS}")


@dataclass(frozen=True)
class BlockStored:
    """Pages of one chain now in `tier` (a `Tier` value), in chain order.

    `parent_block_hash` is the first one's parent (None: not known);
    `token_ids` every page's tokens, in order (empty: not known, e.g. pages
    found on disk); `block_size` tokens per page (None until the engine fills it in).
    """

    tier: str
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer in `tier`: evicted, cleared, found damaged or found gone."""

    tier: str
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page of the namespace left `tier` at once (a replay starts each tier with one)."""

    tier: str


TierEvent = BlockStored | BlockRemoved | AllBlocksCleared
