"""storage layer: L3 disk and L4 remote (Redis/Valkey) behind the cache service.

Public names; see base.py for the protocols, disk.py for the disk tier,
redis.py for the remote tier, tiered.py for how the service chains them,
service.py / client.py for the process boundary, tickets.py for the life of a
ticket (and the quarantine of its slots), deadline.py for when a job stops.

Names load on first use (PEP 562), so importing `asynchicache.storage.base`
(as the cache layer does) loads neither redis-py nor ZeroMQ.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_MODULE_OF = MappingProxyType(
    {
        "BackendStats": "base",
        "Completion": "base",
        "PageLayout": "base",
        "PageRef": "base",
        "Settled": "base",
        "StorageBackend": "base",
        "StorageTier": "base",
        "TicketKind": "base",
        "StorageClient": "client",
        "ClientConfig": "client_config",
        "Deadline": "deadline",
        "DiskBackend": "disk",
        "DiskConfig": "disk",
        "RedisBackend": "redis",
        "RedisConfig": "redis",
        "CacheService": "service",
        "ServiceConfig": "service",
        "run_service": "service",
        "RemoteTierConfig": "tiered",
        "TieredBackend": "tiered",
        "TieredConfig": "tiered",
    }
)

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
