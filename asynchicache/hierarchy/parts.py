"""`CacheParts`: the state the hierarchy's pieces share (tree, pools, ledgers, tickets).

`HiRadixCache` builds one and hands it to its `Evictor`, `Writer` and
`PageLoads`; each piece changes page and slot states only through the ledgers, and
books its storage tickets in `tickets` (slot_tickets.py, shared with the vLLM connector).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace

from asynchicache.hierarchy.l2.jobs import LoadJob, StoreJob, WriteJob
from asynchicache.hierarchy.l2.latency import Latencies
from asynchicache.hierarchy.l2.ledger import (
    QUARANTINED,
    TREE_SLOT_STATES,
    PageState,
    PoolLedger,
    device_ledger,
    host_ledger,
)
from asynchicache.hierarchy.l2.slot_tickets import SlotTickets, Unsettled
from asynchicache.hierarchy.l2.store_queue import StoreQueue
from asynchicache.hierarchy.l2.transfer import TransferEngine
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.pins import PinnedPages
from asynchicache.hierarchy.pools import DevicePool, HostPool, KVLayout
from asynchicache.hierarchy.radix import RadixTree
from asynchicache.hierarchy.stats import CacheStats, Counters, Occupancy
from asynchicache.settings.config import CacheConfig
from asynchicache.storage.base import StorageTier


@dataclass(eq=False)
class CacheParts:
    """Everything one cache's pieces share; all of it lives on the scheduler's thread."""

    config: CacheConfig
    layout: KVLayout
    tree: RadixTree
    device_pool: DevicePool
    host_pool: HostPool | None
    transfer: TransferEngine
    storage: StorageTier | None
    counters: Counters
    strict: InitVar[bool]  # an illegal ledger transition raises (else it is counted)
    device: PoolLedger = field(init=False)  # L1 page states
    host: PoolLedger = field(init=False)  # L2 slot states (size 0 without an L2 tier)
    transfers: dict[int, WriteJob | LoadJob] = field(default_factory=dict)
    # Storage tickets: open ones with their jobs, unsettled ones with their slots (and, for a
    # store, the node whose L2 copies stay held until Settled).
    tickets: SlotTickets[StoreJob | LoadJob, RadixNode] = field(default_factory=SlotTickets)
    pins: PinnedPages = field(default_factory=PinnedPages)  # chains L2 does not evict
    store_queue: StoreQueue = field(default_factory=StoreQueue)  # stores of new pages, waiting
    latency: Latencies = field(default_factory=Latencies)  # transfer durations per tier

    def __post_init__(self, strict: bool) -> None:
        slots = self.host_pool.num_slots if self.host_pool is not None else 0
        self.device = device_ledger(self.config.device_pages, strict, self._illegal)
        self.host = host_ledger(slots, strict, self._illegal)

    def _illegal(self, message: str) -> None:
        self.counters.illegal_transitions += 1

    @property
    def storage_ops(self) -> dict[int, StoreJob | LoadJob]:
        """Storage tickets in flight -> their jobs (the book's, read-only by convention)."""
        return self.tickets.open

    @property
    def unsettled(self) -> dict[int, Unsettled[RadixNode]]:
        """Storage tickets that ended unsettled -> their quarantined slots (the book's)."""
        return self.tickets.unsettled

    @property
    def quarantined(self) -> int:
        return self.host.count(*QUARANTINED)

    @property
    def storage_paused(self) -> bool:
        """Past the quarantine cap no new storage work starts (recompute instead)."""
        q = self.quarantined
        return q > 0 and q >= self.config.max_quarantine_fraction * self.host.size


def snapshot(parts: CacheParts) -> CacheStats:
    """The cache's counters and each pool's occupancy, counted from the ledgers now."""
    dev, host = parts.device, parts.host
    device = Occupancy(
        dev.size, dev.num_free, dev.count(PageState.CACHED),
        dev.count(PageState.PRIVATE, PageState.FILLING),
    )  # fmt: skip
    host_occ = None
    if parts.host_pool is not None:
        cached = host.count(*TREE_SLOT_STATES)
        host_occ = Occupancy(host.size, host.num_free, cached, host.size - host.num_free - cached)
    return CacheStats(
        counters=replace(parts.counters),
        device=device,
        host=host_occ,
        page_bytes=parts.layout.page_bytes,
        pending_transfers=len(parts.transfers),
        pending_storage=len(parts.storage_ops) + len(parts.store_queue),
        stores_waiting=len(parts.store_queue),
        quarantined_slots=host.count(*QUARANTINED),
        unsettled_tickets=len(parts.unsettled),
        page_states=dev.counts(),
        slot_states=host.counts() if parts.host_pool is not None else {},
        latency=parts.latency.snapshot(),
    )
