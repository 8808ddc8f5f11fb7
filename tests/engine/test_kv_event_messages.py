"""The KV event stream's messages: one codec, every type round-trips, garbage is refused."""

from __future__ import annotations

import msgpack
import pytest

from asynchicache.engine.kv_event_messages import KVEventBatch, decode, encode, read_seq, seq_frame
from asynchicache.tiers import AllBlocksCleared, BlockRemoved, BlockStored

H = [bytes([i]) * 16 for i in range(4)]


@pytest.mark.parametrize(
    "batch",
    [
        KVEventBatch(1, 1.5, ()),
        KVEventBatch(
            7,
            1700000000.25,
            (
                BlockStored("device", (H[1], H[2]), H[0], tuple(range(32)), 16),
                BlockStored("disk", (H[3],), None, (), 16),
                BlockRemoved("host", (H[1],)),
                AllBlocksCleared("remote"),
            ),
        ),
        KVEventBatch(9, 2.0, (AllBlocksCleared("device"),), replay=True),
    ],
)
def test_round_trip(batch: KVEventBatch) -> None:
    assert decode(encode(batch)) == batch


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb({"type": "KVEventBatch", "seq": "1", "ts": 1.0, "events": []}),
        msgpack.packb({"type": "KVEventBatch", "seq": 1, "ts": 1.0, "events": [{"type": "X"}]}),
        msgpack.packb({"type": "KVEventBatch", "seq": 1, "ts": 1.0}),
        msgpack.packb(
            {
                "type": "KVEventBatch",
                "seq": 1,
                "ts": 1.0,
                "events": [{"type": "BlockRemoved", "tier": "host", "block_hashes": [5]}],
            }
        ),
    ],
)
def test_malformed_is_a_clean_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


def test_sequence_frames() -> None:
    assert read_seq(seq_frame(2**40 + 3)) == 2**40 + 3 and len(seq_frame(1)) == 8
    with pytest.raises(ValueError):
        read_seq(b"\x01")
