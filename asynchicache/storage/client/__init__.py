"""storage.client: the engine's side of the cache service.

storage_client.py is `StorageClient`, a non-blocking `StorageTier` over ZeroMQ;
client_config.py its settings; tickets.py the life of a ticket (and the quarantine of its
slots); admin_client.py clears, pins and contents; snapshots.py the stats and pins the
service last sent; event_feed.py the service's KV events in order; probe.py whether a
service answers at an address.

Names load on first use (asynchicache.common.faces).
"""

from __future__ import annotations

from asynchicache.common.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
    {
        "ClientConfig": "client_config",
        "EventFeed": "event_feed",
        "ServiceProbe": "probe",
        "StorageClient": "storage_client",
        "TicketBook": "tickets",
    },
)
