"""cache layer: the radix tree over token pages, the L1/L2 pools and the tier hierarchy."""

from asynchicache.cache.hierarchy import (
    HiRadixCache,
    InsertResult,
    IntegrityError,
    LoadTicket,
    MatchHandle,
    MatchResult,
)
from asynchicache.cache.keys import Namespace, chain_hashes, page_hashes
from asynchicache.cache.pools import DevicePool, HostPool, KVLayout, PageAllocator
from asynchicache.cache.stats import CacheStats
from asynchicache.cache.transfer import TransferDone, TransferEngine

__all__ = [
    "CacheStats",
    "DevicePool",
    "HiRadixCache",
    "HostPool",
    "InsertResult",
    "IntegrityError",
    "KVLayout",
    "LoadTicket",
    "MatchHandle",
    "MatchResult",
    "Namespace",
    "PageAllocator",
    "TransferDone",
    "TransferEngine",
    "chain_hashes",
    "page_hashes",
]
