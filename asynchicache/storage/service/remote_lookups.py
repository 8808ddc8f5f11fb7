"""`Exists` past the disk: what L4 (Redis/Valkey) holds of the rest of a chain, asked on a
lookup thread, never on the service's loop.

At most `REMOTE_LOOKUPS` lookups wait; past that the disk's answer goes at once (counted
in `remote_lookups_shed`), as it does for a lookup that waited past `LOOKUP_STALE_S`,
whose asker has given up: a slow Redis degrades to misses. A lookup that fails is a miss
(counted in `remote_lookup_failures`), never a lost reply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from asynchicache.storage.messages import Exists, ExistsReply, Reply
from asynchicache.storage.service.tiered import TieredBackend

log = logging.getLogger(__name__)

REMOTE_LOOKUPS = 64  # Exists waiting on L4 (the lookup thread's queue)
LOOKUP_STALE_S = 1.0  # a lookup queued this long answers from the disk (its asker gave up)


class RemoteLookups:
    """Answers `Exists`: `send` from the loop thread, `send_later` from the lookup thread
    (the loop sends it: a ZeroMQ socket belongs to one thread); `count` the service's
    counters."""

    def __init__(
        self,
        send: Callable[[bytes, Reply], None],
        send_later: Callable[[bytes, Reply], None],
        count: Callable[[str], None],
    ) -> None:
        self._send = send
        self._send_later = send_later
        self._count = count
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="remote-lookup")
        self._waiting = threading.BoundedSemaphore(REMOTE_LOOKUPS)

    def exists(self, ident: bytes, backend: TieredBackend, msg: Exists) -> None:
        """Answer from the disk now, or let the lookup thread add what L4 holds."""
        on_disk, ask_remote = backend.disk_exists(msg.hashes)
        if not ask_remote:
            self._send(ident, ExistsReply(msg.req_id, on_disk, 0))
        elif not self._waiting.acquire(blocking=False):
            self._count("remote_lookups_shed")
            self._send(ident, ExistsReply(msg.req_id, on_disk, 0))
        else:
            queued_at = time.monotonic()
            self._pool.submit(self._lookup, ident, backend, msg, on_disk, queued_at)

    def _lookup(
        self, ident: bytes, backend: TieredBackend, msg: Exists, on_disk: int, queued_at: float
    ) -> None:
        try:
            if time.monotonic() - queued_at > LOOKUP_STALE_S:
                self._count("remote_lookups_shed")
                in_remote = 0
            else:
                in_remote = backend.remote_exists(msg.hashes, on_disk)
        except Exception:  # a lookup that fails is a miss, never a lost reply
            log.exception("cache service: remote lookup failed")
            self._count("remote_lookup_failures")
            in_remote = 0
        finally:
            self._waiting.release()
        self._send_later(ident, ExistsReply(msg.req_id, on_disk + in_remote, in_remote))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
