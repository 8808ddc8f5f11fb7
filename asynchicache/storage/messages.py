"""Messages between a storage client (the engine) and the cache service (ZeroMQ + msgpack).

Only page hashes, L2 slot numbers and statuses cross the socket; KV bytes stay
in the shared L2 pool that both sides map. Every request carries a `req_id`
(the client's ticket id for loads and stores) that its reply repeats.

Besides pages, the engine asks the service to clear a namespace's stored pages
(`Clear`, per tier, optionally one chain root's: a `cache_salt`), to pin and
unpin chains (`Pin`, `Unpin`, `Pins`), and for what its tiers hold
(`Contents`); a client that registered with `events=True` also receives
`StorageEvents` (req_id 0, unasked) whenever pages enter or leave L3/L4
(storage.events).

A client may also hold a lease (`Lease`, renewed as a heartbeat; `Release`): a
service started for vLLM instances runs while a lease is held, and grants one only
when the client's `ServiceSettings` match its own (storage.service.leases).

Loads and stores carry an absolute deadline (`deadline_ns`, CLOCK_MONOTONIC,
shared by the processes of one host; see `storage.deadline`). Every Load and
Store gets exactly one final reply, after which the service touches none of
its slots.

The admin messages (clear, pins, contents, events) are in storage.admin_messages;
both go through the one codec (asynchicache.common.codec), whose `decode` checks every field
against its type hint, so a malformed or hostile frame is a clean `ValueError`, never
a half-built message that fails later inside the service.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from asynchicache.common.codec import Codec
from asynchicache.storage.admin_messages import AdminReply, AdminRequest, check_hashes
from asynchicache.storage.base import BackendStats, PageLayout, PageRef

_MAX_LEASE_S = 3600.0


@dataclass(frozen=True)
class Register:
    """Attach the client's L2 pool (a shared-memory segment of `[slots, page_bytes]`).

    `events`: send this client the namespace's `StorageEvents` from now on."""

    req_id: int
    namespace: bytes
    segment: str
    layout: PageLayout
    events: bool = False


@dataclass(frozen=True)
class RegisterReply:
    """`pid` is the service's process id: its exit tells a client that work it gave up on
    can no longer touch the client's slots. `events_seq`: the client's event subscription
    began after the namespace's event of that number (repeated on every heartbeat; a new
    value, or a new pid, is a new subscription: events in between were not sent)."""

    req_id: int
    slots: int = 0
    error: str | None = None
    pid: int = 0
    events_seq: int = 0


@dataclass(frozen=True)
class Exists:
    req_id: int
    hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        check_hashes(self.hashes)


@dataclass(frozen=True)
class ExistsReply:
    """`pages` leading pages are stored: the first `pages - remote_pages` on disk, the rest
    only in the remote tier."""

    req_id: int
    pages: int
    remote_pages: int = 0


@dataclass(frozen=True)
class Load:
    """Read pages into L2 slots; no page is started after `deadline_ns` (monotonic_ns)."""

    req_id: int
    hashes: tuple[bytes, ...]
    slots: tuple[int, ...]
    deadline_ns: int | None = None

    def __post_init__(self) -> None:
        check_hashes(self.hashes)
        if len(self.hashes) != len(self.slots):
            raise ValueError(f"{len(self.hashes)} hashes but {len(self.slots)} slots")


@dataclass(frozen=True)
class PagesReply:
    """The one final reply to a Load or a Store: its first `pages_ok` of `pages_requested`
    pages were done; `error` says why the rest were not."""

    req_id: int
    pages_ok: int
    pages_requested: int
    error: str | None = None


@dataclass(frozen=True)
class LoadReply(PagesReply):
    pages_from_remote: int = 0  # of pages_ok, read from L4 (Redis) rather than disk


@dataclass(frozen=True)
class Store:
    """Write pages from their L2 slots (which the client leaves untouched until the reply).

    The service copies each slot once, before `deadline_ns`, and writes from its copies.
    """

    req_id: int
    pages: tuple[PageRef, ...]
    deadline_ns: int | None = None

    def __post_init__(self) -> None:
        check_hashes(tuple(p.page_hash for p in self.pages))


@dataclass(frozen=True)
class StoreReply(PagesReply):
    """A Store's final reply."""


@dataclass(frozen=True)
class Cancel:
    """Stop load/store `target`: skipped if not started, else stopped at its next page."""

    req_id: int
    target: int


@dataclass(frozen=True)
class CancelReply:
    """`settled`: the service will never touch the target's slots (it had not started it,
    or does not know it and will refuse it if it comes). False: it is running and stops at
    its next page; its final reply follows."""

    req_id: int
    target: int
    settled: bool


@dataclass(frozen=True)
class Stats:
    req_id: int


@dataclass(frozen=True)
class StatsReply:
    req_id: int
    disk: BackendStats | None = None
    service: dict[str, float] = field(default_factory=dict)
    remote: BackendStats | None = None


@dataclass(frozen=True)
class ServiceSettings:
    """What a service runs with that changes what its engines get (where pages live, how
    many, which are admitted): a client that leases it says what it wants, and a service
    that runs otherwise refuses, naming the fields. How it writes (O_DIRECT, syncs) is
    left out. `disk_cache_dir` is a resolved path; None: no remote tier, or no L4 expiry."""

    disk_cache_dir: str
    disk_cache_bytes: int
    remote_url: str | None = None
    remote_ttl: int | None = None
    remote_admit_hits: int = 0  # L4 -> L3 promotion admission (RemoteTierConfig)
    remote_admit_tokens: int = 0

    def differences(self, other: ServiceSettings) -> tuple[str, ...]:
        """The fields whose values differ, in field order."""
        return tuple(
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        )


@dataclass(frozen=True)
class Lease:
    """Keep the service running while process `holder` lives and renews this within
    `ttl_s` (a heartbeat); granted when `settings` equal the service's own (None: a client
    that would not start a service takes it as it runs)."""

    req_id: int
    holder: int  # a pid on the service's host
    settings: ServiceSettings | None
    ttl_s: float

    def __post_init__(self) -> None:
        if self.holder <= 0:
            raise ValueError(f"a lease holder is a pid, got {self.holder}")
        if not 0 < self.ttl_s <= _MAX_LEASE_S:
            raise ValueError(f"lease ttl_s must be in (0, {_MAX_LEASE_S}], got {self.ttl_s}")


@dataclass(frozen=True)
class Release:
    """Give up the sender's lease (its engine is stopping)."""

    req_id: int


@dataclass(frozen=True)
class LeaseReply:
    """`granted`, or refused for `conflicts` (ServiceSettings fields whose values differ;
    `settings` are the service's). `holders`: leases held now; `pid`: the service's."""

    req_id: int
    granted: bool
    settings: ServiceSettings
    conflicts: tuple[str, ...] = ()
    holders: int = 0
    pid: int = 0


@dataclass(frozen=True)
class ErrorReply:
    """A request the service could not take: `code` is "unregistered", "malformed" or "internal"."""

    req_id: int
    code: str
    message: str = ""


Request = Register | Exists | Load | Store | Cancel | Stats | Lease | Release | AdminRequest
Reply = (
    RegisterReply
    | ExistsReply
    | LoadReply
    | StoreReply
    | CancelReply
    | StatsReply
    | LeaseReply
    | ErrorReply
    | AdminReply
)

CODEC = Codec("storage", (*typing.get_args(Request), *typing.get_args(Reply)))
MESSAGE_TYPES = CODEC.messages
encode = CODEC.encode
decode = CODEC.decode  # ValueError (only) on anything malformed
