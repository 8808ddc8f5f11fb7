"""storage.service: the cache service process (L3 and L4 behind one ZeroMQ socket).

server.py is the process (`CacheService`, `run_service`); config.py its configuration
and its flag table (the one `serve`, this package's `python -m` and the vLLM launcher
use); cli.py / __main__.py its command line; tiered.py chains disk and remote; jobs.py
runs requests on its workers; leases.py keeps it alive for the engines that lease it;
offline_clear.py clears a folder (and its L4 keys) with no service running.

Names load on first use (asynchicache.common.faces).
"""

from __future__ import annotations

from asynchicache.common.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
    {
        "CacheService": "server",
        "RemoteTierConfig": "tiered",
        "ServiceConfig": "service_config",
        "TieredBackend": "tiered",
        "TieredConfig": "tiered",
        "client_in_thread": "in_thread",
        "default_address": "config",
        "default_runtime_dir": "config",
        "open_tiered": "tiered",
        "prepare_address": "config",
        "run_service": "server",
    },
)
