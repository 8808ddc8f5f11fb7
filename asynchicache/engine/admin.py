"""The engine's cache administration: the ops of an `AdminRequest`, answered between steps.

    health  stats  traces  lookup  integrity  clear  pin  unpin

`clear` empties the tiers asked for (default: device, host and disk): L1 and
L2 here (cache.clearing), disk and Redis through the cache service
(`StorageClient.clear`), one `cache_salt`'s pages or everyone's; pinned pages
stay unless `include_pinned`, pages in use stay and are counted.

`pin` keeps a prompt's full pages from eviction in L2 (cache.pins) and L3 (a pin
file in the disk folder, written by the cache service: it survives restarts and
binds every server on the folder), and sends the pages it holds down to disk
now. Pins may hold `--max-pinned-fraction` of each tier: past it the pin is
refused with code "over_limit" (HTTP 409). The engine's copy of the pins is
refreshed from the service's listing (`refresh_pins`), so L2 honours the pins
other servers on the folder made.

Calls to the cache service wait a bounded time: these are an operator's acts,
rare, and the engine's loop runs them between two steps.

No answer names a salt: a pin's tenant is its `owner`, a keyed fingerprint of the
salt (storage.tenant_key; the key is the disk folder's, so every server on it names
a tenant alike). The HTTP layer lists pins and owners to the admin key only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from asynchicache.common.keys import Namespace, chain_hashes
from asynchicache.common.tenant_key import TenantKey
from asynchicache.common.tiers import STORAGE_TIERS, TIERS, Tier
from asynchicache.engine.protocol import MAX_CACHE_SALT_CHARS, AdminReply, AdminRequest
from asynchicache.engine.sampling.prompt_logits import PromptLogits
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pins import PinnedChain
from asynchicache.storage.admin_messages import ClearReply, PinReply, PinsReply
from asynchicache.storage.client.admin_client import AdminRequests

log = logging.getLogger(__name__)

DEFAULT_CLEAR_TIERS = (Tier.DEVICE.value, Tier.HOST.value, Tier.DISK.value)
CLEAR_TIMEOUT_S = 60.0
PIN_TIMEOUT_S = 10.0
PINS_TIMEOUT_S = 1.0
PINS_MAX_AGE_S = 1.0  # /cache/stats: the service's pins listing at most this old


class AdminError(Exception):
    """An op refused: `code` is "bad_request", "over_limit" or "unavailable"."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class AdminSubject(Protocol):
    """What the admin reads of its engine (engine.engine.Engine is one)."""

    cache: HiRadixCache
    namespace: Namespace
    prompt_logits: PromptLogits

    @property
    def model_name(self) -> str: ...

    def stats(self) -> dict: ...

    def traces(self) -> dict: ...

    def integrity(self) -> dict: ...


class EngineAdmin:
    """Answers `AdminRequest`s for one engine."""

    def __init__(self, engine: AdminSubject) -> None:
        self.engine = engine
        self.cache = engine.cache
        storage = engine.cache.storage
        self.storage = storage if isinstance(storage, AdminRequests) else None
        self._tenant_key: TenantKey | None = None
        # The service's last pins listing: `/cache/stats` shows it, never asking the service
        # on the engine's thread (the upkeep refreshes it when idle, pin/unpin/clear after).
        self._below: PinsReply | None = None
        self._below_at = 0.0  # CLOCK_MONOTONIC of that listing

    def owner(self, salt: str) -> str:
        """The tenant of `salt` as listings name it ("" for none)."""
        if self._tenant_key is None:  # on first use: the cache service made the folder
            root = self.cache.config.disk_cache_dir
            self._tenant_key = (TenantKey.for_folder(root) if self.storage is not None
                                and root is not None else TenantKey.ephemeral())  # fmt: skip
        return self._tenant_key.owner(salt)

    def handle(self, msg: AdminRequest) -> AdminReply:
        try:
            return AdminReply(msg.req_id, True, self._payload(msg))
        except AdminError as exc:
            return AdminReply(msg.req_id, False, {"code": exc.code}, str(exc))
        except Exception as exc:  # an admin call must never take the engine down
            log.exception("admin %s failed", msg.op)
            return AdminReply(msg.req_id, False, {"code": "internal"}, str(exc))

    def _payload(self, msg: AdminRequest) -> dict[str, Any]:
        if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise AdminError(f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters",
                             "bad_request")  # fmt: skip
        e = self.engine
        if msg.op == "health":
            return {"ok": True, "model": e.model_name}
        if msg.op == "stats":
            return {**e.stats(), "pins": self.pins()}
        if msg.op == "traces":
            return e.traces()
        if msg.op == "lookup":
            return dict(self.cache.lookup(list(msg.token_ids), salt=msg.cache_salt))
        if msg.op == "integrity":
            return e.integrity()
        if msg.op == "clear":
            return self.clear(msg.tiers or DEFAULT_CLEAR_TIERS, msg.cache_salt,
                              msg.include_pinned)  # fmt: skip
        if msg.op == "pin":
            return self.pin(list(msg.token_ids), msg.cache_salt, msg.ttl_s)
        if msg.op == "unpin":
            return self.unpin(msg.pin_ids, list(msg.token_ids), msg.cache_salt)
        raise AdminError(
            f"unknown admin op {msg.op!r}; known: health, stats, traces, lookup, integrity, "
            "clear, pin, unpin",
            "bad_request",
        )

    # -- clear ------------------------------------------------------------------------------

    def clear(self, tiers: tuple[str, ...], salt: str, include_pinned: bool) -> dict[str, Any]:
        wanted = set(TIERS) if "all" in tiers else set(tiers)
        unknown = sorted(wanted - set(TIERS))
        if unknown:
            raise AdminError(f"unknown tiers {unknown}; known: {list(TIERS)} or all",
                             "bad_request")  # fmt: skip
        done = self.cache.clear_tiers(Tier.DEVICE in wanted, Tier.HOST in wanted, salt or None,
                                      include_pinned)  # fmt: skip
        if Tier.DEVICE in wanted:  # a cleared prompt misses: its kept logits go with its pages
            self.engine.prompt_logits.clear(salt or None)
        out: dict[str, dict[str, Any]] = {
            tier: {"removed": t.removed, "kept_in_use": t.kept_in_use,
                   "kept_pinned": t.kept_pinned, "error": None}
            for tier, t in done.tiers.items()
        }  # fmt: skip
        below = [t for t in STORAGE_TIERS if t in wanted]
        if below:
            out.update(self._clear_storage(below, salt, include_pinned))
        if include_pinned:
            self._drop_pins(salt)
        scope = [t for t in TIERS if t in wanted]
        removed = sum(t["removed"] for t in out.values())
        return {"scope": scope, "owner": self.owner(salt) or None, "include_pinned": include_pinned,
                "removed": removed, "cleared": removed, "tiers": out}  # fmt: skip

    def _clear_storage(
        self, tiers: list[str], salt: str, include_pinned: bool
    ) -> dict[str, dict[str, Any]]:
        def failed(why: str) -> dict[str, dict[str, Any]]:
            return {t: {"removed": 0, "kept_in_use": 0, "kept_pinned": 0, "error": why}
                    for t in tiers}  # fmt: skip

        if self.storage is None:
            return failed("no disk tier (--no-disk-cache)")
        root = self._root(salt) if salt else b""
        reply = self.storage.clear(tiers, root, include_pinned, timeout_s=CLEAR_TIMEOUT_S)
        if not isinstance(reply, ClearReply):
            return failed(f"the cache service did not answer in {CLEAR_TIMEOUT_S:.0f}s")
        out = failed("not configured")
        for part in reply.tiers:
            out[part.tier] = {"removed": part.removed, "kept_in_use": 0,
                              "kept_pinned": part.pinned_kept, "error": part.error}  # fmt: skip
        return out

    def _drop_pins(self, salt: str) -> None:
        pins = self.cache.pins
        owner = self.owner(salt)
        pins.clear(None if not salt else [c.pin_id for c in pins.chains() if c.owner == owner])
        self.refresh_pins()

    # -- pins -------------------------------------------------------------------------------

    def _root(self, salt: str) -> bytes:
        ns = self.engine.namespace
        return (ns.with_salt(salt) if salt else ns).digest()

    def _chain(self, tokens: list[int], salt: str) -> tuple[bytes, ...]:
        ps = self.cache.page_size
        full = len(tokens) // ps
        if full == 0:
            raise AdminError(f"the prompt has {len(tokens)} tokens: a pin needs at least one "
                             f"full page of {ps}", "bad_request")  # fmt: skip
        return tuple(chain_hashes(self._root(salt), tokens[: full * ps], ps))

    def pin(self, tokens: list[int], salt: str, ttl_s: float | None) -> dict[str, Any]:
        if ttl_s is not None and not ttl_s > 0:
            raise AdminError(f"ttl_s must be positive, got {ttl_s}", "bad_request")
        hashes = self._chain(tokens, salt)
        self._check_host_room(hashes)
        owner = self.owner(salt)
        reply = self._pin_below(hashes, salt, owner, ttl_s)
        expires = reply.pin.expires_at if reply is not None and reply.pin is not None else (
            None if ttl_s is None else time.time() + ttl_s)  # fmt: skip
        pin_id = hashes[-1].hex()
        self.cache.pins.add(PinnedChain(pin_id, hashes, expires, owner))
        if reply is not None:
            self.refresh_pins()  # the folder's pinned bytes, for /cache/stats
        cached = self.cache.persist(tokens[: len(hashes) * self.cache.page_size], salt)
        return {
            "pin_id": pin_id, "owner": owner or None, "pages": len(hashes),
            "tokens": len(hashes) * self.cache.page_size, "expires_at": expires,
            "pages_cached": cached, "persistent": reply is not None,
            "pages_on_disk": reply.pages_present if reply is not None else 0,
            "pinned_bytes": reply.pinned_bytes if reply is not None else 0,
            "limit_bytes": reply.limit_bytes if reply is not None else 0,
        }  # fmt: skip

    def _check_host_room(self, hashes: tuple[bytes, ...]) -> None:
        slots = self.cache.parts.host.size
        if slots == 0:
            return
        limit = int(self.cache.config.max_pinned_fraction * slots)
        pins = self.cache.pins
        new = pins.new_pages(hashes)
        if pins.num_pages + new > limit:
            raise AdminError(
                f"pinning {new} more pages would pin {pins.num_pages + new} of the host "
                f"tier's {slots} pages; --max-pinned-fraction allows {limit} "
                f"({pins.num_pages} pinned already)",
                "over_limit",
            )

    def _pin_below(
        self, hashes: tuple[bytes, ...], salt: str, owner: str, ttl_s: float | None
    ) -> PinReply | None:
        """The pin file in the disk folder (None: no disk tier, the pin lives in L2 only)."""
        if self.storage is None:
            return None
        reply = self.storage.pin(hashes, self._root(salt), owner, ttl_s, timeout_s=PIN_TIMEOUT_S)
        if reply is None:
            raise AdminError("the cache service did not answer the pin", "unavailable")
        if reply.code == "over_limit":
            raise AdminError(reply.error or "over --max-pinned-fraction", "over_limit")
        if reply.code is not None:
            raise AdminError(f"the cache service refused the pin: {reply.code}: {reply.error}",
                             "unavailable" if reply.code == "no_disk" else "internal")  # fmt: skip
        return reply

    def unpin(self, pin_ids: tuple[str, ...], tokens: list[int], salt: str) -> dict[str, Any]:
        ids = list(pin_ids) or [self._chain(tokens, salt)[-1].hex()]
        removed = self.cache.pins.remove(ids)
        if self.storage is not None:
            below = self.storage.unpin(ids, timeout_s=PIN_TIMEOUT_S)
            if below is None:
                raise AdminError("the cache service did not answer the unpin", "unavailable")
            removed = max(removed, below)
            self.refresh_pins()
        return {"pin_ids": ids, "removed": removed}

    def refresh_pins(self, timeout_s: float = PINS_TIMEOUT_S) -> PinsReply | None:
        """Take the cache service's pins (every server's on the folder) as L2's; None when
        it did not answer (the engine keeps its own copy)."""
        if self.storage is None:
            return None
        reply = self.storage.pins(timeout_s=timeout_s)
        if reply is not None:
            self._take_below(reply, time.monotonic())
        return reply

    def _take_below(self, reply: PinsReply, at: float) -> None:
        self._below, self._below_at = reply, at
        self.cache.pins.replace(
            PinnedChain(p.pin_id, p.pages, p.expires_at, p.owner) for p in reply.pins
        )

    def pins(self) -> dict[str, Any]:
        """The pins, for `/cache/stats`: the service's latest listing (a snapshot: never a
        round trip on the engine's thread; an old one asks for the next), else L2's."""
        snap = self.storage.pins_snapshot(PINS_MAX_AGE_S) if self.storage is not None else None
        if snap is not None and snap[1] > self._below_at:
            self._take_below(*snap)
        below = self._below
        pins = self.cache.pins
        slots = self.cache.parts.host.size
        # server/cache_admin.py's fresh_stats waits for a listing from after its call.
        at: dict[str, float] = (
            {"at_monotonic_s": self._below_at} if self.storage is not None else {}
        )
        return {**at,
            "pinned": [{"pin_id": c.pin_id, "owner": c.owner or None, "pages": len(c.pages),
                        "expires_at": c.expires_at} for c in pins.chains()],
            "pinned_pages": pins.num_pages,
            "host_limit_pages": int(self.cache.config.max_pinned_fraction * slots),
            "disk_pinned_pages": below.pinned_pages if below is not None else None,
            "disk_pinned_bytes": below.pinned_bytes if below is not None else None,
            "disk_limit_bytes": below.limit_bytes if below is not None else None,
        }  # fmt: skip
