"""vLLM's KV event wire format, which every KV-aware router reads (vllm-router's `kv_aware`,
llm-d's precise prefix-cache scorer, Dynamo's KV router).

One ZeroMQ message per batch, three frames `[topic, seq, payload]`:

* `topic`: `--kv-events-topic` (b"" by default), for SUB filtering;
* `seq`: the batch number, 8 bytes big-endian, consecutive from 0 (a jump is a gap; a
  number lower than the last one means the publisher restarted);
* `payload`: msgpack of vLLM's `KVEventBatch`, a msgspec `array_like` struct:
  `[ts, [event, ...], data_parallel_rank]`; each event a msgspec tagged struct, a map
  `{"type": name, field: value, ...}` in vLLM 0.32's field order, fields that equal
  their default left out (`omit_defaults`):

      BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                        medium, lora_name, [extra_keys, ..., ownership, ...]
      BlockRemoved      block_hashes, medium, [..., ownership]
      AllBlocksCleared  (nothing)

Block hashes are ints, as vLLM sends them by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`:
the low 64 bits of the hash); ours are the low 64 bits of our chained page hash, so every
process and every instance names a page alike. Routers use them as opaque keys (to chain
a run to its parent, to remove); they match a request by the `token_ids` (vllm-router and
llm-d hash them again, by block). A first page's parent is None.

Media, one per tier (`MEDIUM`): L1 "GPU" (the device tier, also when it is on CPU), L2
"CPU", L3 "DISK", L4 "EXTERNAL", the names Dynamo and vllm-router read as their device,
host, disk and external tiers. Pages of a tier shared by the fleet carry `ownership`
(a pool name, llm-d's `pool:<name>` convention): a router credits them to every instance
instead of the one that announced them.

`decode` checks every field it reads, so a subscriber gets a ValueError on anything
malformed (the bytes are read by codec.unpack_foreign, the one safe msgpack decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from asynchicache.common.codec import unpack_foreign
from asynchicache.common.tiers import Tier

SEQ_BYTES = 8
END_SEQ = -1  # the seq of the replay socket's end marker (vLLM's)

MEDIUM: dict[str, str] = {
    Tier.DEVICE: "GPU",
    Tier.HOST: "CPU",
    Tier.DISK: "DISK",
    Tier.REMOTE: "EXTERNAL",
}
TIER_OF_MEDIUM: dict[str, str] = {m: t for t, m in MEDIUM.items()}


def external_hash(page_hash: bytes) -> int:
    """A page's block hash on the wire: the low 64 bits, as vLLM turns its hashes to ints."""
    return int.from_bytes(page_hash, "big") & ((1 << 64) - 1)


@dataclass(frozen=True)
class BlockStored:
    """A run of pages, each the child of the one before, now in `medium`."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # every page's tokens, in order (empty: not published)
    block_size: int
    medium: str
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # one per block
    ownership: str | None = None  # a shared tier's pool (None: this instance's own)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Everything this instance announced is gone (a router keeps the pools' pages)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int = 0


def _event(e: Event) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(e.block_hashes),
            "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": None,
            "medium": e.medium,
            "lora_name": e.lora_name,
        }
        if e.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in e.extra_keys]
        if e.ownership is not None:
            out["ownership"] = e.ownership
        return out
    if isinstance(e, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.ownership is not None:
            out["ownership"] = e.ownership
        return out
    return {"type": "AllBlocksCleared"}


def encode(batch: KVEventBatch) -> bytes:
    body = [batch.ts, [_event(e) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> KVEventBatch:
    """One batch; ValueError on anything malformed or mistyped."""
    try:
        body = unpack_foreign(data)
    except ValueError as exc:
        raise ValueError(f"a KV event batch is not msgpack: {exc}") from exc
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise ValueError("a KV event batch is an array [ts, events, rank]")
    ts, events = body[0], body[1]
    rank = body[2] if len(body) == 3 else 0
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise ValueError("a KV event batch is [ts: float, events: array, ...]")
    if rank is not None and not _is_int(rank):
        raise ValueError("data_parallel_rank must be an int")
    return KVEventBatch(float(ts), tuple(_decode_event(e) for e in events), rank or 0)


def _decode_event(raw: Any) -> Event:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ValueError("a KV event is a map tagged by 'type'")
    kind = raw["type"]
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw, "block_hashes"), _str(raw, "medium"),
                            _opt_str(raw, "ownership"))  # fmt: skip
    if kind != "BlockStored":
        raise ValueError(f"unknown KV event type {kind!r}")
    parent = raw.get("parent_block_hash")
    if parent is not None and not _is_int(parent):
        raise ValueError("parent_block_hash must be an int or nil")
    tokens = raw.get("token_ids")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise ValueError("token_ids must be an array of ints")
    size = raw.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError("block_size must be a positive int")
    extra = raw.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise ValueError("extra_keys must be an array or nil")
    return BlockStored(
        _hashes(raw, "block_hashes"),
        parent,
        tuple(tokens),
        size,
        _str(raw, "medium"),
        _opt_str(raw, "lora_name"),
        None if extra is None else tuple(None if k is None else tuple(k) for k in extra),
        _opt_str(raw, "ownership"),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _hashes(raw: dict[str, Any], key: str) -> tuple[int, ...]:
    v = raw.get(key)
    if not isinstance(v, list) or not all(_is_int(h) for h in v):
        raise ValueError(f"{key} must be an array of ints")
    return tuple(v)


def _str(raw: dict[str, Any], key: str) -> str:
    v = raw.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{key} must be a string")
    return v


def _opt_str(raw: dict[str, Any], key: str) -> str | None:
    v = raw.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{key} must be a string or nil")
    return v


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def read_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def weight(event: Event) -> int:
    """What an event counts against a batch's bound: a stored run once per page."""
    return len(event.block_hashes) if isinstance(event, BlockStored) else 1


def split(events: Sequence[Event], max_events: int) -> list[list[Event]]:
    """`events` in order, in parts of at most `max_events` (a long run is split, its tail's
    parent the head's last page)."""
    parts: list[list[Event]] = [[]]
    room = max_events
    for event in events:
        while weight(event) > room:
            if isinstance(event, BlockStored) and room > 0:
                head, event = _split_run(event, room)
                parts[-1].append(head)
            parts.append([])
            room = max_events
        parts[-1].append(event)
        room -= weight(event)
    return [p for p in parts if p]


def _split_run(run: BlockStored, n: int) -> tuple[BlockStored, BlockStored]:
    cut = n * run.block_size
    ids, hashes, extra = run.token_ids, run.block_hashes, run.extra_keys
    head = replace(run, block_hashes=hashes[:n], token_ids=ids[:cut],
                   extra_keys=None if extra is None else extra[:n])  # fmt: skip
    tail = replace(run, block_hashes=hashes[n:], parent_block_hash=hashes[n - 1],
                   token_ids=ids[cut:],
                   extra_keys=None if extra is None else extra[n:])  # fmt: skip
    return head, tail
