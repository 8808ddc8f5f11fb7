"""What the cache service's workers do with a request, and the reply it gets.

Loads and stores move pages between a client's L2 slots and the tiers (their
deadline is checked before every page: storage.service.server). Clears, pins and
contents are administration of the client's namespace: they touch no slot.
A failed job still gets exactly one reply (`failed`).
"""

from __future__ import annotations

import numpy as np

from asynchicache.common.deadline import Deadline
from asynchicache.common.tiers import Tier
from asynchicache.storage.admin_messages import (
    AdminRequest,
    Clear,
    ClearedPages,
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
from asynchicache.storage.base import ClearScope
from asynchicache.storage.disk.disk_pins import PinLimitError
from asynchicache.storage.messages import ErrorReply, Load, LoadReply, Reply, Store, StoreReply
from asynchicache.storage.service.tiered import TieredBackend

Work = Load | Store | AdminRequest


def execute(msg: Work, backend: TieredBackend, pool: np.ndarray, deadline: Deadline) -> Reply:
    if isinstance(msg, Load):
        read = backend.load(msg.hashes, msg.slots, pool, deadline)
        ok, n = read.pages_ok, len(msg.hashes)
        error = None if ok == n else f"{n - ok} of {n} pages missed"
        return LoadReply(msg.req_id, ok, n, error, read.pages_from_remote)
    if isinstance(msg, Store):
        ok = backend.put(msg.pages, pool, deadline)
        n = len(msg.pages)
        return StoreReply(msg.req_id, ok, n, None if ok == n else f"{n - ok} of {n} not stored")
    if isinstance(msg, Clear):
        return _clear(msg, backend)
    if isinstance(msg, PinChain):
        return _pin(msg, backend)
    if isinstance(msg, Unpin):
        return UnpinReply(msg.req_id, backend.disk.unpin(msg.pin_ids))
    if isinstance(msg, Pins):
        usage = backend.disk.pin_usage()
        pins = tuple(backend.disk.pins.active())
        pinned = backend.disk.pinned_pages
        return PinsReply(msg.req_id, pins, pinned, usage.pinned_bytes, usage.limit_bytes)
    return _contents(msg, backend)


def failed(msg: Work, error: str) -> Reply:
    if isinstance(msg, Load):
        return LoadReply(msg.req_id, 0, len(msg.hashes), error)
    if isinstance(msg, Store):
        return StoreReply(msg.req_id, 0, len(msg.pages), error)
    return ErrorReply(msg.req_id, "internal", error)


def _clear(msg: Clear, backend: TieredBackend) -> ClearReply:
    scope = ClearScope(msg.root, msg.include_pinned)
    done = backend.clear(scope, [Tier(t) for t in msg.tiers])
    parts = tuple(
        ClearedPages(tier.value, c.removed, c.pinned_kept, c.error) for tier, c in done.items()
    )
    if Tier.REMOTE.value in msg.tiers and Tier.REMOTE not in done:
        parts += (ClearedPages(Tier.REMOTE.value, error="no remote tier configured"),)
    return ClearReply(msg.req_id, sum(p.removed for p in parts), parts)


def _pin(msg: PinChain, backend: TieredBackend) -> PinReply:
    try:
        done = backend.disk.pin(msg.pages, msg.root, msg.owner, msg.ttl_s)
    except PinLimitError as exc:
        return PinReply(msg.req_id, None, 0, exc.would_pin, exc.limit_bytes, "over_limit", str(exc))
    limit = done.limit
    return PinReply(msg.req_id, done.pin, done.pages_present, limit.pinned_bytes, limit.limit_bytes)


def _contents(msg: Contents, backend: TieredBackend) -> ContentsReply:
    found = backend.contents([Tier(t) for t in msg.tiers])
    return ContentsReply(
        msg.req_id,
        found.seq,
        tuple(h for h, _ in found.disk),
        tuple(p for _, p in found.disk),
        tuple(found.remote or ()),
        found.remote is not None,
    )
