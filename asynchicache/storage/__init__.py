"""storage layer: L3 disk and L4 remote (Redis/Valkey) behind the cache service.

Four packages, each with a short face: disk/ (L3), remote/ (L4), service/ (the
cache service process, which chains them: service/tiered.py) and client/ (the
engine's side of the service). What both sides need stays here: base.py (the
protocols and page layout), messages.py / admin_messages.py (the wire), header.py
(a page's header, on disk and in Redis), page_keys.py / page_cipher.py (its MAC and
encryption), events.py (the tiers' KV events), page_index.py, lineage.py,
write_behind.py. What every layer shares (shm, sockets, deadlines, liveness, fileio,
tenant keys) is in common/.

Names load on first use (asynchicache.common.faces), so importing `asynchicache.storage.base`
(as the hierarchy does) loads neither redis-py nor ZeroMQ.
"""

from __future__ import annotations

from asynchicache.common.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
    {
        "BackendStats": "base",
        "Completion": "base",
        "PageLayout": "base",
        "PageRef": "base",
        "Settled": "base",
        "StorageBackend": "base",
        "StorageTier": "base",
        "TicketKind": "base",
        "StorageClient": "client.storage_client",
        "ClientConfig": "client.client_config",
        "DiskBackend": "disk.disk_backend",
        "DiskConfig": "disk.disk_config",
        "RedisBackend": "remote.remote_backend",
        "RedisConfig": "remote.remote_config",
        "CacheService": "service.server",
        "ServiceConfig": "service.service_config",
        "run_service": "service.server",
        "RemoteTierConfig": "service.tiered",
        "TieredBackend": "service.tiered",
        "TieredConfig": "service.tiered",
    },
)
