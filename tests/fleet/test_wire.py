"""vLLM's KV event wire format (kv_events/wire.py): the exact bytes vLLM 0.32's msgspec
encoder writes (tests/vllm/test_kv_events_wire.py decodes ours with vLLM's own decoder),
a round trip, and a decoder that answers anything hostile with a ValueError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynchicache.kv_events import wire

STORED = wire.BlockStored((1, 2**64 - 1), None, tuple(range(32)), 16, "GPU")
BATCH = wire.KVEventBatch(
    1.5,
    (
        STORED,
        wire.BlockStored((7,), 2**63, (), 16, "EXTERNAL", ownership="pool:fleet"),
        wire.BlockRemoved((1,), "CPU"),
        wire.AllBlocksCleared(),
    ),
)


def test_the_layout_is_vllms() -> None:
    """Array-like batch, events as maps tagged "type" in vLLM 0.32's field order, fields
    that equal their default left out (msgspec's omit_defaults)."""
    body = msgpack.unpackb(wire.encode(BATCH), raw=False)
    assert isinstance(body, list) and body[0] == 1.5 and body[2] == 0
    stored, pool, removed, cleared = body[1]
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                            "block_size", "lora_id", "medium", "lora_name"]  # fmt: skip
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [1, 2**64 - 1]
    assert pool["ownership"] == "pool:fleet" and "extra_keys" not in pool
    assert list(removed) == ["type", "block_hashes", "medium"]
    assert cleared == {"type": "AllBlocksCleared"}


def test_a_round_trip() -> None:
    assert wire.decode(wire.encode(BATCH)) == BATCH


def test_long_runs_split_with_their_parents() -> None:
    run = wire.BlockStored(tuple(range(10, 15)), 9, tuple(range(5 * 4)), 4, "CPU")
    parts = wire.split([run, wire.BlockRemoved((3,), "GPU")], 2)
    runs = [e for p in parts for e in p]
    assert [len(p) for p in parts] == [1, 1, 2]
    assert [e.parent_block_hash for e in runs[:3]] == [9, 11, 13]  # type: ignore[union-attr]
    assert sum((e.token_ids for e in runs[:3]), ()) == run.token_ids  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "body",
    [
        {"ts": 1.0, "events": []},
        [1.0],
        ["1.0", []],
        [1.0, [{"type": "Nope"}]],
        [1.0, [["BlockStored", [1], None, [], 16, None, "GPU", None]]],  # array-tagged
        [1.0, [{"type": "BlockStored", "block_hashes": [b"x"], "parent_block_hash": None,
                "token_ids": [], "block_size": 16, "medium": "GPU"}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "token_ids": [True], "block_size": 16, "medium": "GPU"}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "token_ids": [], "block_size": 0, "medium": "GPU"}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1]}]],
    ],
)  # fmt: skip
def test_malformed_batches_are_value_errors(body: object) -> None:
    with pytest.raises(ValueError):
        wire.decode(msgpack.packb(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_value_error(data: bytes) -> None:
    """Only a ValueError escapes (anything else would fail the test), or a batch comes out."""
    try:
        out = wire.decode(data)
    except ValueError:
        return
    assert isinstance(out, wire.KVEventBatch)
