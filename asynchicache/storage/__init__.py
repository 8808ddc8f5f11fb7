"""storage layer: L3 disk (and later L4 remote) behind the cache service.

Public names; see base.py for the protocols, disk.py for the disk tier,
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
from asynchicache.storage.service import CacheService, ServiceConfig, run_service

__all__ = [
    "BackendStats",
    "CacheService",
    "ClientConfig",
    "Completion",
    "DiskBackend",
    "DiskConfig",
    "PageLayout",
    "PageRef",
    "ServiceConfig",
    "StorageBackend",
    "StorageClient",
    "StorageTier",
    "TicketKind",
    "run_service",
]
