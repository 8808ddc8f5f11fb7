"""storage.service: the cache service process (L3 and L4 behind one ZeroMQ socket).

server.py is the process (`CacheService`, `run_service`); service_config.py its
configuration and its flag table (the one `serve`, `asynchicache service` and the vLLM
launcher use); service_cli.py its command line; tiered.py chains disk and remote;
service_jobs.py runs requests on its workers; remote_lookups.py asks L4 off the workers;
leases.py keeps it alive for the engines that lease it; segments.py maps the clients'
L2 segments; in_thread.py runs it in a thread
of this process behind a client (tests, small deployments); offline_clear.py clears a
folder (and its L4 keys) with no service running.

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
        "default_address": "service_config",
        "default_runtime_dir": "service_config",
        "open_tiered": "tiered",
        "prepare_address": "service_config",
        "run_service": "server",
    },
)
