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

Loads and stores carry an absolute deadline (`deadline_ns`, CLOCK_MONOTONIC,
shared by the processes of one host; see `storage.deadline`). Every Load and
Store gets exactly one final reply, after which the service touches none of
its slots.

The admin messages (clear, pins, contents, events) are in storage.admin_messages;
`encode`/`decode` are the only codec, for both. `decode` checks every field against its
type hint, so a malformed or hostile frame is a clean `ValueError`, never a
half-built message that fails later inside the service.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgpack

from asynchicache.storage.admin_messages import (
    Clear,
    ClearedPages,
    ClearReply,
    Contents,
    ContentsReply,
    PinChain,
    PinReply,
    Pins,
    PinsReply,
    StorageEvents,
    Unpin,
    UnpinReply,
    check_hashes,
)
from asynchicache.storage.base import BackendStats, PageLayout, PageRef
from asynchicache.storage.events import EVENT_TYPES
from asynchicache.storage.pins import Pin


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
    req_id: int
    pages: int


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
class LoadReply:
    req_id: int
    pages_ok: int
    pages_requested: int
    error: str | None = None
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
class StoreReply:
    req_id: int
    pages_ok: int
    pages_requested: int
    error: str | None = None


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
class ErrorReply:
    """A request the service could not take: `code` is "unregistered", "malformed" or "internal"."""

    req_id: int
    code: str
    message: str = ""


Request = (
    Register | Exists | Load | Store | Cancel | Stats | Clear | PinChain | Unpin | Pins | Contents
)
Reply = (
    RegisterReply
    | ExistsReply
    | LoadReply
    | StoreReply
    | CancelReply
    | StatsReply
    | ClearReply
    | PinReply
    | UnpinReply
    | PinsReply
    | ContentsReply
    | StorageEvents
    | ErrorReply
)

MESSAGE_TYPES: MappingProxyType[str, type] = MappingProxyType(
    {
        cls.__name__: cls
        for cls in (
            Register,
            RegisterReply,
            Exists,
            ExistsReply,
            Load,
            LoadReply,
            Store,
            StoreReply,
            Cancel,
            CancelReply,
            Stats,
            StatsReply,
            Clear,
            ClearReply,
            PinChain,
            PinReply,
            Unpin,
            UnpinReply,
            Pins,
            PinsReply,
            Contents,
            ContentsReply,
            StorageEvents,
            ErrorReply,
        )
    }
)
_NESTED = (PageLayout, PageRef, BackendStats, ClearedPages, Pin, *EVENT_TYPES)
_HINTS = MappingProxyType(
    {cls: typing.get_type_hints(cls) for cls in (*MESSAGE_TYPES.values(), *_NESTED)}
)


def encode(msg: Any) -> bytes:
    if type(msg).__name__ not in MESSAGE_TYPES:
        raise TypeError(f"not a storage message: {type(msg).__name__}")
    return msgpack.packb(_to_plain(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode one message; raises ValueError (only) on anything malformed."""
    try:
        plain = msgpack.unpackb(data, raw=False, strict_map_key=True)
        cls = MESSAGE_TYPES.get(plain.get("__t")) if isinstance(plain, dict) else None
        if cls is None:
            raise ValueError("not a typed storage message")
        return _from_plain(plain, cls)
    except ValueError as exc:
        raise ValueError(f"malformed storage message: {exc}") from exc
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean "malformed"
        raise ValueError(f"malformed storage message: {type(exc).__name__}: {exc}") from exc


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        body = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__t": type(obj).__name__, **body}
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _from_plain(value: Any, hint: Any) -> Any:
    """`value` checked against (and shaped as) type `hint`."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return _from_union(value, typing.get_args(hint))
    if origin is tuple:
        (item, _) = typing.get_args(hint)
        return tuple(_from_plain(x, item) for x in _expect(value, list))
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        return {
            _from_plain(k, key_t): _from_plain(v, val_t) for k, v in _expect(value, dict).items()
        }
    if hint in _HINTS:
        return _from_dataclass(value, hint)
    return _from_scalar(value, hint)


def _from_union(value: Any, options: tuple[Any, ...]) -> Any:
    if value is None and type(None) in options:
        return None
    classes = [o for o in options if o in _HINTS]
    if classes:  # a union of messages (events): the value names its type
        tag = value.get("__t") if isinstance(value, dict) else None
        for cls in classes:
            if cls.__name__ == tag:
                return _from_dataclass(value, cls)
        raise ValueError(f"expected one of {[c.__name__ for c in classes]}, got {tag!r}")
    for option in options:
        if option is not type(None):
            return _from_plain(value, option)
    raise ValueError(f"unexpected {value!r}")


def _from_dataclass(value: Any, cls: type) -> Any:
    obj = _expect(value, dict)
    if obj.get("__t") != cls.__name__:
        raise ValueError(f"expected {cls.__name__}, got {obj.get('__t')!r}")
    hints = _HINTS[cls]
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            kwargs[f.name] = _from_plain(obj[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}.{f.name} missing")
    return cls(**kwargs)


def _from_scalar(value: Any, hint: Any) -> Any:
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise ValueError("expected int, got bool")
    if hint in (int, str, bytes, bool) and isinstance(value, hint):
        return value
    raise ValueError(f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


def _expect(value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value
