"""storage.client: the engine's side of the cache service.

storage_client.py is `StorageClient`, a non-blocking `StorageTier` over ZeroMQ; config.py
its settings; tickets.py the life of a ticket (and the quarantine of its slots);
admin.py clears, pins and contents; event_feed.py the service's KV events in order;
probe.py whether a service answers at an address.

Names load on first use (PEP 562): importing one module of the package does not load
the others.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_MODULE_OF = MappingProxyType(
    {
        "ClientConfig": "config",
        "EventFeed": "event_feed",
        "ServiceProbe": "probe",
        "StorageClient": "storage_client",
        "TicketBook": "tickets",
    }
)

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
