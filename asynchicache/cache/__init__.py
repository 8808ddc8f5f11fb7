"""cache layer: the radix tree over token pages, the L1/L2 pools and the tier hierarchy."""

from asynchicache.cache.hierarchy import HiRadixCache
from asynchicache.cache.integrity import IntegrityError
from asynchicache.cache.jobs import LoadTicket
from asynchicache.cache.keys import Namespace, chain_hashes, page_hashes
from asynchicache.cache.ledger import LedgerError, PageState, PoolLedger, SlotState
from asynchicache.cache.pools import DevicePool, HostPool, KVLayout
from asynchicache.cache.results import LockedPages, MatchHandle, MatchResult
from asynchicache.cache.stats import CacheStats
from asynchicache.cache.transfer import TransferDone, TransferEngine

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
