"""storage.remote: L4, pages as values in Redis/Valkey (standalone or cluster).

remote_backend.py is the tier (`RedisBackend`); remote_config.py its settings and key
prefix; topology.py the URL and the cluster's slots; resp.py / link.py / pipeline.py the
wire (our own RESP client, its connections, pipelined page calls); value.py a page's
value format; breaker.py stops calls while the server is out; remote_admin.py clears and
listings.

Names load on first use (asynchicache.common.faces).
"""

from __future__ import annotations

from asynchicache.common.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
    {
        "CircuitBreaker": "breaker",
        "RedisBackend": "remote_backend",
        "RedisConfig": "remote_config",
        "RemoteEndpoint": "topology",
        "RespConnection": "resp",
        "parse_remote_url": "topology",
        "remote_key_prefix": "remote_config",
    },
)
