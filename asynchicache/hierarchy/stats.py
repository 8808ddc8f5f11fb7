"""Cache counters: the mutable tallies the hierarchy keeps and the frozen snapshot it reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class Counters:
    """Running totals, owned and updated by one `HiRadixCache` (scheduler thread only)."""

    match_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    inserted_pages: int = 0
    device_evicted_pages: int = 0
    host_evicted_pages: int = 0
    device_to_host_pages: int = 0
    device_to_host_bytes: int = 0
    host_to_device_pages: int = 0
    host_to_device_bytes: int = 0
    host_to_storage_pages: int = 0
    host_to_storage_bytes: int = 0
    storage_to_host_pages: int = 0
    storage_to_host_bytes: int = 0
    writes_skipped: int = 0  # L1 -> L2 copies not started because L2 had no room
    transfer_failures: int = 0
    store_failures: int = 0
    load_failures: int = 0
    loads_given_up: int = 0  # loads whose caller stopped waiting (they still land, if they can)
    prefetches: int = (
        0  # storage -> L2 reads started for queued requests (engine/scheduling/prefetch.py)
    )
    prefetched_pages: int = 0  # pages those reads brought into L2
    completion_failures: int = 0  # completion handlers that raised (their job still ended)
    illegal_transitions: int = 0  # page/slot state changes the ledger refused (a bug: logged)
    tickets_late: int = 0  # storage tickets that timed out while the service may still run them
    slots_quarantined: int = 0  # L2 slots that entered quarantine, ever (gauge: quarantined_slots)
    settled_tickets: int = 0  # timed-out tickets whose Settled released their slots
    storage_loads_paused: int = 0  # storage reads not started: quarantine past its cap
    storage_stores_paused: int = 0  # pages not stored: quarantine past its cap

    def count_match(self, tokens: int, device: int, host: int, storage: int) -> None:
        """One `match` of `tokens` tokens that found those per tier."""
        self.match_tokens += tokens
        self.device_hit_tokens += device
        self.host_hit_tokens += host
        self.storage_hit_tokens += storage


@dataclass(frozen=True)
class Occupancy:
    """Pages of one pool: free + cached (in the tree) + in use (requests, copies) == total."""

    total: int
    free: int
    cached: int
    in_use: int


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the counters and of each pool's occupancy (`HiRadixCache.stats()`).

    `quarantined_slots` are L2 slots a timed-out storage ticket may still
    touch (counted in `host.in_use` when not in the tree, `host.cached` when
    they are a timed-out store's); `page_states` and `slot_states` count every
    L1 page and L2 slot by ledger state.
    """

    counters: Counters
    device: Occupancy
    host: Occupancy | None
    page_bytes: int
    pending_transfers: int
    pending_storage: int  # storage tickets in flight + stores waiting (store_queue.py)
    stores_waiting: int = 0  # of which waiting for a quiet engine
    quarantined_slots: int = 0
    unsettled_tickets: int = 0
    page_states: dict[str, int] = dataclasses.field(default_factory=dict)
    slot_states: dict[str, int] = dataclasses.field(default_factory=dict)
    # Transfer durations per direction and tier (hierarchy/l2/latency.py), as histogram counts.
    latency: dict[str, dict[str, dict[str, object]]] = dataclasses.field(default_factory=dict)

    @property
    def hit_tokens(self) -> int:
        c = self.counters
        return c.device_hit_tokens + c.host_hit_tokens + c.storage_hit_tokens

    def to_dict(self) -> dict[str, object]:
        """Plain nested dict for admin replies and metrics."""
        return dataclasses.asdict(self)
