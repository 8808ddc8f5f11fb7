"""The namespace administration a `StorageClient` sends to the cache service.

Each call waits (a bounded time) for its reply: these are for the engine's
admin path (`/cache/clear`, `/cache/pin`, a router's replay), never for the
scheduler's. None means the service did not answer in time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from asynchicache.common.tiers import STORAGE_TIERS
from asynchicache.storage.admin_messages import (
    Clear,
    ClearReply,
    Contents,
    ContentsReply,
    PinChain,
    PinReply,
    Pins,
    PinsReply,
    Unpin,
    UnpinReply,
)
from asynchicache.storage.messages import Lease, LeaseReply, Release, ServiceSettings


class AdminRequests:
    """Clear, pin, unpin, list pins, list contents, leases (mixed into `StorageClient`)."""

    def _request(self, make: Callable[[int], object], timeout_s: float) -> object | None:
        """Send `make(req_id)` and wait up to `timeout_s` for its reply."""
        raise NotImplementedError

    def pins_snapshot(self, max_age_s: float = 1.0) -> tuple[PinsReply, float] | None:
        """The latest pins listing and when it came, without waiting (StorageClient)."""
        raise NotImplementedError

    def clear(
        self,
        tiers: Sequence[str] = STORAGE_TIERS,
        root: bytes = b"",
        include_pinned: bool = False,
        timeout_s: float = 60.0,
    ) -> ClearReply | None:
        """Remove our namespace's stored pages from `tiers` ("disk", "remote"): all, or the
        chains of `root` (a cache_salt's h_0); pinned ones stay unless `include_pinned`.
        Per-tier counts; None when the service did not answer in time."""
        msg = partial(Clear, tiers=tuple(tiers), root=root, include_pinned=include_pinned)
        reply = self._request(msg, timeout_s)
        return reply if isinstance(reply, ClearReply) else None

    def pin(
        self,
        pages: Sequence[bytes],
        root: bytes,
        owner: str = "",
        ttl_s: float | None = None,
        timeout_s: float = 10.0,
    ) -> PinReply | None:
        """Keep a chain (its hashes from the first page; `root` its h_0) from eviction in L3
        by every service on the folder, for `ttl_s` (None: until unpinned). `code`
        "over_limit" when it would pass --max-pinned-fraction."""
        msg = partial(PinChain, pages=tuple(pages), root=root, owner=owner, ttl_s=ttl_s)
        reply = self._request(msg, timeout_s)
        return reply if isinstance(reply, PinReply) else None

    def unpin(self, pin_ids: Sequence[str], timeout_s: float = 10.0) -> int | None:
        """Remove pins by id (a chain's last page hash, hex); how many there were."""
        reply = self._request(partial(Unpin, pin_ids=tuple(pin_ids)), timeout_s)
        return reply.removed if isinstance(reply, UnpinReply) else None

    def pins(self, timeout_s: float = 5.0) -> PinsReply | None:
        """The namespace's unexpired pins (all services'), and the folder's pinned bytes."""
        reply = self._request(Pins, timeout_s)
        return reply if isinstance(reply, PinsReply) else None

    def contents(
        self, tiers: Sequence[str] = STORAGE_TIERS, timeout_s: float = 60.0
    ) -> ContentsReply | None:
        """What the tiers hold now; its disk part is exact at event `seq` (apply only later
        events). For a late subscriber's replay, and after `take_events()` reports a gap."""
        reply = self._request(partial(Contents, tiers=tuple(tiers)), timeout_s)
        return reply if isinstance(reply, ContentsReply) else None

    def lease(
        self, holder: int, settings: ServiceSettings | None, ttl_s: float, timeout_s: float = 1.0
    ) -> LeaseReply | None:
        """Take or renew a lease on the service for process `holder` (storage.service.leases);
        refused, naming the fields, when `settings` (None: any) are not the service's."""
        msg = partial(Lease, holder=holder, settings=settings, ttl_s=ttl_s)
        reply = self._request(msg, timeout_s)
        return reply if isinstance(reply, LeaseReply) else None

    def release(self, timeout_s: float = 1.0) -> LeaseReply | None:
        """Give our lease up (a leased service with no lease left stops)."""
        reply = self._request(Release, timeout_s)
        return reply if isinstance(reply, LeaseReply) else None
