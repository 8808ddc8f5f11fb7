"""The KV event stream's messages: what a router subscribing to `--kv-events-endpoint` reads.

The shapes are vLLM's KV events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared` in a `KVEventBatch`), with our page hashes (16 bytes, the
chained hash of DESIGN.md) and a `tier` for where the pages are: "device" (L1),
"host" (L2), "disk" (L3), "remote" (L4). A page may be in several tiers at once.

Wire format (ZeroMQ):

* PUB `--kv-events-endpoint`: multipart `[topic, seq, payload]`, vLLM's framing:
  `topic` (b"" unless configured), `seq` the batch number as 8 bytes big-endian
  (consecutive from 1: a jump means batches were lost), `payload` one
  `KVEventBatch` encoded by `encode`.
* ROUTER `--kv-events-replay-endpoint`: a REQ (or DEALER) socket sends any frame
  and gets back `[seq, payload]`: a `KVEventBatch` with `replay=True` holding
  the current contents of every tier (an `AllBlocksCleared` per tier, then
  `BlockStored` events), exact as of batch `seq`. Apply it in place of what you
  held, then only the live batches numbered after `seq`.

`encode` / `decode` are the only codec (msgpack maps tagged with the type's
name); `decode` checks every field's type, so a subscriber gets a clean
ValueError on anything malformed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgpack

TIERS = ("device", "host", "disk", "remote")
SEQ_BYTES = 8


@dataclass(frozen=True)
class BlockStored:
    """Pages of one chain now in `tier`, in chain order. `parent_block_hash` is the first
    one's parent (None: not known); `token_ids` every page's tokens, in order (empty: not
    known, e.g. pages found on disk); `block_size` tokens per page."""

    tier: str
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer in `tier`."""

    tier: str
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page left `tier` (a replay starts each tier with one)."""

    tier: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """Events published together, number `seq`; `ts` is unix time. `replay`: a snapshot of
    every tier as of batch `seq` (the replay socket's answer)."""

    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    replay: bool = False


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch)
}
_HINTS = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}


def encode(batch: KVEventBatch) -> bytes:
    return msgpack.packb(_to_plain(batch), use_bin_type=True)


def decode(data: bytes) -> KVEventBatch:
    """One batch; raises ValueError on anything malformed or mistyped."""
    try:
        out = _from_plain(msgpack.unpackb(data, raw=False, strict_map_key=True), KVEventBatch)
    except ValueError as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc
    except Exception as exc:  # msgpack's many exception types all mean "malformed"
        raise ValueError(f"malformed KV event batch: {type(exc).__name__}: {exc}") from exc
    return out


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def read_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        body = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"type": type(obj).__name__, **body}
    if isinstance(obj, tuple | list):
        return [_to_plain(x) for x in obj]
    return obj


def _from_plain(value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(hint):
            return None
        classes = [c for c in typing.get_args(hint) if c in _HINTS]
        if classes:
            tag = value.get("type") if isinstance(value, dict) else None
            cls = next((c for c in classes if c.__name__ == tag), None)
            if cls is None:
                raise ValueError(f"unknown event type {tag!r}")
            return _from_plain(value, cls)
        (option,) = [c for c in typing.get_args(hint) if c is not type(None)]
        return _from_plain(value, option)
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {type(value).__name__}")
        item = typing.get_args(hint)[0]
        return tuple(_from_plain(x, item) for x in value)
    if hint in _HINTS:
        if not isinstance(value, dict) or value.get("type") != hint.__name__:
            raise ValueError(f"expected {hint.__name__}")
        kwargs = {}
        for f in dataclasses.fields(hint):
            if f.name in value:
                kwargs[f.name] = _from_plain(value[f.name], _HINTS[hint][f.name])
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"{hint.__name__}.{f.name} missing")
        return hint(**kwargs)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bytes, bool) and isinstance(value, hint) and (
        hint is bool or not isinstance(value, bool)
    ):
        return value
    raise ValueError(f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
