"""The KV event stream's messages: what a router subscribing to `--kv-events-endpoint` reads.

The shapes are vLLM's KV events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared` in a `KVEventBatch`; defined once in asynchicache/tiers.py for
every layer), with our page hashes (16 bytes, the
chained hash of DESIGN.md) and a `tier` for where the pages are: "device" (L1),
"host" (L2), "disk" (L3), "remote" (L4). A page may be in several tiers at once.

Wire format (ZeroMQ):

* PUB `--kv-events-endpoint`: multipart `[topic, seq, payload]`, vLLM's framing:
  `topic` (b"" unless configured), `seq` the batch number as 8 bytes big-endian
  (consecutive from 1: a jump means batches were lost), `payload` one
  `KVEventBatch` encoded by `encode`.
* ROUTER `--kv-events-replay-endpoint`: a REQ (or DEALER) socket sends `[b"replay"]`
  and gets back `[seq, payload]`: a `KVEventBatch` with `replay=True`, part 0 of
  `parts` of the current contents of every tier (an `AllBlocksCleared` per tier,
  then `BlockStored` events), exact as of batch `seq`. A part holds at most 10,000
  events (a stored run counts once per page: engine/kv_replay.py); ask for the
  next with `[b"replay", seq, part]` (8 bytes each, as `seq_frame` writes them).
  An answer that is part 0 again (of another `seq`) means the snapshot expired:
  start over with it. Apply all parts together in place of what you held, then
  only the live batches numbered after `seq`.

`encode` / `decode` go through the one codec (asynchicache/codec.py; maps tagged
with the type's name under "type", as vLLM's events are); `decode` checks every
field's type, so a subscriber gets a clean ValueError on anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass

from asynchicache.codec import Codec
from asynchicache.tiers import AllBlocksCleared, BlockRemoved, BlockStored, TierEvent

SEQ_BYTES = 8


@dataclass(frozen=True)
class KVEventBatch:
    """Events published together, number `seq`; `ts` is unix time. `replay`: a snapshot of
    every tier as of batch `seq` (the replay socket's answer), part `part` of `parts`."""

    seq: int
    ts: float
    events: tuple[TierEvent, ...]
    replay: bool = False
    part: int = 0
    parts: int = 1


CODEC = Codec("KV event", (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared), "type")
MESSAGE_TYPES = CODEC.messages


def encode(batch: KVEventBatch) -> bytes:
    return CODEC.encode(batch)


def decode(data: bytes) -> KVEventBatch:
    """One batch; raises ValueError on anything malformed or mistyped."""
    out = CODEC.decode(data)
    if not isinstance(out, KVEventBatch):
        raise ValueError(f"malformed KV event batch: a {type(out).__name__}, not a batch")
    return out


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def read_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
