"""Messages between the HTTP server and the engine process (ZeroMQ + msgpack).

Every message is a typed dataclass; `encode`/`decode` are the only codec and a
round-trip test covers each type. Token ids cross the socket, never text: the
HTTP process tokenizes and detokenizes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class GenerateRequest:
    rid: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens served from each tier instead of recomputed."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.remote


@dataclass(frozen=True)
class TokenOutput:
    """New tokens for one request; the last one has `finished` set."""

    rid: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    error: str | None = None


@dataclass(frozen=True)
class AdminRequest:
    """A cache admin call answered with an `AdminReply` of the same `req_id`.

    `op` is one of "stats" (counters per tier), "lookup" (tokens of
    `token_ids` each tier holds, without touching LRU), "clear" (drop every
    unlocked cached page in every tier), "health".
    """

    req_id: str
    op: str
    token_ids: tuple[int, ...] = ()
    cache_salt: str = ""


@dataclass(frozen=True)
class AdminReply:
    req_id: str
    ok: bool
    payload: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        SamplingParams,
        GenerateRequest,
        AbortRequest,
        CachedTokens,
        TokenOutput,
        AdminRequest,
        AdminReply,
    )
}


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        body = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__t": type(obj).__name__, **body}
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict) and "__t" in obj:
        cls = MESSAGE_TYPES.get(obj["__t"])
        if cls is None:
            raise ValueError(f"unknown message type {obj['__t']!r}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in obj:
                value = _from_plain(obj[f.name])
                kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)
    if isinstance(obj, list):
        return [_from_plain(x) for x in obj]
    return obj


def encode(msg: Any) -> bytes:
    return msgpack.packb(_to_plain(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode one message; raises ValueError on anything malformed or mistyped."""
    try:
        plain = msgpack.unpackb(data, raw=False)
        msg = _from_plain(plain)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed engine message: {exc}") from exc
    if not dataclasses.is_dataclass(msg):
        raise ValueError("malformed engine message: not a typed message")
    _check_types(msg)
    return msg


def _check_types(msg: Any) -> None:
    """Every field holds what its annotation says (a mistyped field would fail deep in the
    engine, taking it down, instead of here)."""
    hints = typing.get_type_hints(type(msg))
    for f in dataclasses.fields(msg):
        if not _conforms(getattr(msg, f.name), hints[f.name]):
            raise ValueError(f"malformed engine message: {type(msg).__name__}.{f.name} mistyped")


def _conforms(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, tuple) and all(_conforms(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            _check_types(value)
            return True
        return False
    if hint is float:  # msgpack keeps 0 an int
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
