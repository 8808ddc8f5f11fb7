"""What only the remote-tier tests share: the type of their backend factory fixture.

The redis-server launcher, pools and pages live in tests/support; RedisServer and
redis_server_binary are re-exported because tests/vllm/vllm_helpers.py loads this
file by path (lead: point it at tests/support/redis_server.py and drop them here).
"""

from __future__ import annotations

from collections.abc import Callable

from redis_server import RedisServer, redis_server_binary

from asynchicache.storage.redis import RedisBackend

__all__ = ["Backends", "RedisServer", "redis_server_binary"]

Backends = Callable[..., RedisBackend]
