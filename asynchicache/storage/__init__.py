"""storage layer: L3 disk and L4 remote (Redis/Valkey) behind the cache service.

Public names; see base.py for the protocols, disk.py for the disk tier,
redis.py for the remote tier, tiered.py for how the service chains them,
service.py / client.py for the process boundary, tickets.py for the life of a
ticket (and the quarantine of its slots), deadline.py for when a job stops.
"""

from asynchicache.storage.base import (
    BackendStats,
    Completion,
    PageLayout,
    PageRef,
    Settled,
    StorageBackend,
    StorageTier,
    TicketKind,
)
from asynchicache.storage.client import StorageClient
from asynchicache.storage.client_config import ClientConfig
from asynchicache.storage.deadline import Deadline
from asynchicache.storage.disk import DiskBackend, DiskConfig
from asynchicache.storage.redis import RedisBackend, RedisConfig
from asynchicache.storage.service import CacheService, ServiceConfig, run_service
from asynchicache.storage.tiered import RemoteTierConfig, TieredBackend, TieredConfig

__all__ = [
    "BackendStats",
    "CacheService",
    "ClientConfig",
    "Completion",
    "Deadline",
    "DiskBackend",
    "DiskConfig",
    "PageLayout",
    "PageRef",
    "RedisBackend",
    "RedisConfig",
    "RemoteTierConfig",
    "ServiceConfig",
    "Settled",
    "StorageBackend",
    "StorageClient",
    "StorageTier",
    "TicketKind",
    "TieredBackend",
    "TieredConfig",
    "run_service",
]
