"""storage.remote: L4, pages as values in Redis/Valkey (standalone or cluster).

backend.py is the tier (`RedisBackend`); config.py its settings and key prefix;
topology.py the URL and the cluster's slots; resp.py / link.py / pipeline.py the wire
(our own RESP client, its connections, pipelined page calls); value.py a page's value
format; breaker.py stops calls while the server is out; admin.py clears and listings.

Names load on first use (PEP 562): importing one module of the package does not load
the others.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_MODULE_OF = MappingProxyType(
    {
        "CircuitBreaker": "breaker",
        "RedisBackend": "backend",
        "RedisConfig": "config",
        "RemoteEndpoint": "topology",
        "RespConnection": "resp",
        "parse_remote_url": "topology",
        "remote_key_prefix": "config",
    }
)

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
