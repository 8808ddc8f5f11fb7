"""What only the remote-tier tests share: the type of their backend factory fixture.

The redis-server launcher, pools and pages live in tests/support.
"""

from __future__ import annotations

from collections.abc import Callable

from asynchicache.storage.remote.remote_backend import RedisBackend

Backends = Callable[..., RedisBackend]
