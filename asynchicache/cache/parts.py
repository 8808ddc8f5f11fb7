"""`CacheParts`: the state the hierarchy's pieces share (tree, pools, ledgers, tickets).

`HiRadixCache` builds one and hands it to its `Evictor`, `Writer` and
`Loader`; each piece changes page and slot states only through the ledgers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asynchicache.cache.jobs import LoadJob, StoreJob, Unsettled, WriteJob
from asynchicache.cache.ledger import QUARANTINED, PoolLedger
from asynchicache.cache.pins import PinnedPages
from asynchicache.cache.pools import DevicePool, HostPool, KVLayout
from asynchicache.cache.radix import RadixTree
from asynchicache.cache.stats import Counters
from asynchicache.cache.transfer import TransferEngine
from asynchicache.config import CacheConfig
from asynchicache.storage.base import StorageTier


@dataclass(eq=False)
class CacheParts:
    """Everything one cache's pieces share; all of it lives on the scheduler's thread."""

    config: CacheConfig
    layout: KVLayout
    tree: RadixTree
    device_pool: DevicePool
    host_pool: HostPool | None
    device: PoolLedger  # L1 page states
    host: PoolLedger  # L2 slot states (size 0 without an L2 tier)
    transfer: TransferEngine
    storage: StorageTier | None
    counters: Counters
    transfers: dict[int, WriteJob | LoadJob] = field(default_factory=dict)
    storage_ops: dict[int, StoreJob | LoadJob] = field(default_factory=dict)
    unsettled: dict[int, Unsettled] = field(default_factory=dict)  # storage ticket -> slots
    pins: PinnedPages = field(default_factory=PinnedPages)  # chains L2 does not evict

    @property
    def quarantined(self) -> int:
        return self.host.count(*QUARANTINED)

    @property
    def storage_paused(self) -> bool:
        """Past the quarantine cap no new storage work starts (recompute instead)."""
        q = self.quarantined
        return q > 0 and q >= self.config.max_quarantine_fraction * self.host.size
