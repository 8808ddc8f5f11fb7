"""Admin messages between a storage client (the engine) and the cache service.

Clear a namespace's stored pages per tier (optionally one cache_salt's chain
root), pin and unpin chains, list pins, ask what the tiers hold, and the
events the service sends unasked to subscribed clients. Encoded and decoded
by storage.messages, like every message.
"""

from __future__ import annotations

from dataclasses import dataclass

from asynchicache.common.tiers import STORAGE_TIERS, TierEvent

HASH_BYTES = 16


def check_hashes(hashes: tuple[bytes, ...]) -> None:
    # Hashes become file names: anything but a 16-byte digest is refused at the boundary.
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"page hashes must be {HASH_BYTES} bytes")


def _check_tiers(tiers: tuple[str, ...]) -> None:
    unknown = sorted(set(tiers) - set(STORAGE_TIERS))
    if unknown:
        raise ValueError(f"unknown tiers {unknown}; known: {list(STORAGE_TIERS)}")


@dataclass(frozen=True)
class Clear:
    """Remove the client's namespace's stored pages from `tiers` ("disk", "remote").

    `root` (16 bytes) limits it to the chains starting from that h_0, a cache_salt's
    `Namespace.with_salt(salt).digest()`; b"" clears every page. Pinned pages stay
    unless `include_pinned` (which drops the pins of that root, or all, as well)."""

    req_id: int
    tiers: tuple[str, ...] = STORAGE_TIERS
    root: bytes = b""
    include_pinned: bool = False

    def __post_init__(self) -> None:
        _check_tiers(self.tiers)
        if self.root:
            check_hashes((self.root,))


@dataclass(frozen=True)
class ClearedPages:
    """One tier's part of a clear: pages removed, pinned pages kept, or why it failed."""

    tier: str
    removed: int = 0
    pinned_kept: int = 0
    error: str | None = None


@dataclass(frozen=True)
class ClearReply:
    """`removed`: all tiers together; `tiers`: each tier asked for that the service has."""

    req_id: int
    removed: int
    tiers: tuple[ClearedPages, ...] = ()


@dataclass(frozen=True)
class Pin:
    """One pinned chain, as a `PinReply` / `PinsReply` carries it (the disk tier keeps
    each as a file: storage.disk.disk_pins). `expires_at` is unix time (None: until
    unpinned); `owner` is storage.tenant_key's fingerprint of the salt ("": unsalted)."""

    pin_id: str
    root: bytes
    pages: tuple[bytes, ...]
    page_file_bytes: int
    owner: str = ""
    created_at: float = 0.0
    expires_at: float | None = None

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.page_file_bytes

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True)
class PinChain:
    """Keep a chain's pages from eviction in L3 (every service on the folder honours it).

    `pages` are the chain's hashes from its first page, `root` its h_0 (the namespace's
    digest, or a cache_salt's), `owner` the tenant for listings (storage.tenant_key: a
    keyed fingerprint of the salt, never the salt), `ttl_s` None: until unpinned.
    Pinning the same chain again replaces its pin (new TTL)."""

    req_id: int
    pages: tuple[bytes, ...]
    root: bytes
    owner: str = ""
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not self.pages:
            raise ValueError("a pin needs at least one page")
        check_hashes((*self.pages, self.root))
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")


@dataclass(frozen=True)
class PinReply:
    """The pin written, and how many leading pages of its chain are stored on disk now.

    `code` "over_limit": the pin would pass --max-pinned-fraction (nothing written; an
    HTTP 409); "no_disk" / "internal": failed. `pinned_bytes`/`limit_bytes` are the
    folder's, with this pin when it was written."""

    req_id: int
    pin: Pin | None = None
    pages_present: int = 0
    pinned_bytes: int = 0
    limit_bytes: int = 0
    code: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Unpin:
    """Remove pins by id (a chain's pin id is its last page hash in hex)."""

    req_id: int
    pin_ids: tuple[str, ...]


@dataclass(frozen=True)
class UnpinReply:
    req_id: int
    removed: int


@dataclass(frozen=True)
class Pins:
    """List the namespace's unexpired pins."""

    req_id: int


@dataclass(frozen=True)
class PinsReply:
    """Unexpired pins of the namespace (every service's: they live in the folder);
    `pinned_pages` of their pages are stored on disk now; the folder's pinned and
    allowed bytes."""

    req_id: int
    pins: tuple[Pin, ...] = ()
    pinned_pages: int = 0
    pinned_bytes: int = 0
    limit_bytes: int = 0


@dataclass(frozen=True)
class Contents:
    """What the namespace's tiers hold now (a late event subscriber's replay)."""

    req_id: int
    tiers: tuple[str, ...] = STORAGE_TIERS

    def __post_init__(self) -> None:
        _check_tiers(self.tiers)


@dataclass(frozen=True)
class ContentsReply:
    """`disk_hashes[i]`'s parent is `disk_parents[i]` (b"": unknown). The disk part is
    exact at event `seq`: apply only `StorageEvents` numbered after it. `remote_listed`
    is False when there is no remote tier or it did not answer (`remote_hashes` empty)."""

    req_id: int
    seq: int
    disk_hashes: tuple[bytes, ...] = ()
    disk_parents: tuple[bytes, ...] = ()
    remote_hashes: tuple[bytes, ...] = ()
    remote_listed: bool = False


@dataclass(frozen=True)
class StorageEvents:
    """Events of the namespace, unasked (req_id 0): event i is number `seq + i`."""

    req_id: int
    seq: int
    events: tuple[TierEvent, ...]


AdminRequest = Clear | PinChain | Unpin | Pins | Contents
AdminReply = ClearReply | PinReply | UnpinReply | PinsReply | ContentsReply | StorageEvents
