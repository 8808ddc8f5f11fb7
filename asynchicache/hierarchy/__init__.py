"""cache layer: the radix tree over token pages, the L1/L2 pools and the tier hierarchy."""

from asynchicache.common.keys import Namespace, chain_hashes, page_hashes
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.integrity import IntegrityError
from asynchicache.hierarchy.l2.jobs import LoadTicket
from asynchicache.hierarchy.l2.ledger import LedgerError, PageState, PoolLedger, SlotState
from asynchicache.hierarchy.l2.transfer import TransferDone, TransferEngine
from asynchicache.hierarchy.pools import DevicePool, HostPool, KVLayout
from asynchicache.hierarchy.results import LockedPages, MatchHandle, MatchResult
from asynchicache.hierarchy.stats import CacheStats

__all__ = [
    "CacheStats",
    "DevicePool",
    "HiRadixCache",
    "HostPool",
    "IntegrityError",
    "KVLayout",
    "LedgerError",
    "LoadTicket",
    "LockedPages",
    "MatchHandle",
    "MatchResult",
    "Namespace",
    "PageState",
    "PoolLedger",
    "SlotState",
    "TransferDone",
    "TransferEngine",
    "chain_hashes",
    "page_hashes",
]
