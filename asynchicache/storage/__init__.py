"""storage layer: L3 disk and L4 remote (Redis/Valkey) behind the cache service.

Public names; see base.py for the protocols, disk.py for the disk tier,
redis.py for the remote tier, tiered.py for how the service chains them,
service.py / client.py for the process boundary.
"""

from asynchicache.storage.base import (
    BackendStats,
    Completion,
    PageLayout,
    PageRef,
    StorageBackend,
    StorageTier,
    TicketKind,
)
from asynchicache.storage.client import ClientConfig, StorageClient
from asynchicache.storage.disk import DiskBackend, DiskConfig
from asynchicache.storage.redis import RedisBackend, RedisConfig
from asynchicache.storage.service import CacheService, ServiceConfig, run_service
from asynchicache.storage.tiered import RemoteTierConfig, TieredBackend, TieredConfig

__all__ = [
    "BackendStats",
    "CacheService",
    "ClientConfig",
    "Completion",
    "DiskBackend",
    "DiskConfig",
    "PageLayout",
    "PageRef",
    "RedisBackend",
    "RedisConfig",
    "RemoteTierConfig",
    "ServiceConfig",
    "StorageBackend",
    "StorageClient",
    "StorageTier",
    "TicketKind",
    "TieredBackend",
    "TieredConfig",
    "run_service",
]
