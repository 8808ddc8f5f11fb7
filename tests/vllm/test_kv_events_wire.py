"""Our KV events are vLLM's: vLLM 0.32's own msgspec decoder (the type its publisher
encodes, and llm-d's and Dynamo's subscribers mirror) reads our payload, with every
field in place; and our decoder reads what vLLM's encoder writes."""

from __future__ import annotations

import msgspec

from asynchicache.kv_events import wire


def test_vllms_decoder_reads_our_batches() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    ours = wire.KVEventBatch(
        2.5,
        (
            wire.BlockStored((11, 2**64 - 1), None, tuple(range(32)), 16, "GPU"),
            wire.BlockStored((12,), 11, tuple(range(16)), 16, "EXTERNAL", ownership="pool:x"),
            wire.BlockRemoved((11,), "CPU"),
            wire.AllBlocksCleared(),
        ),
    )
    theirs = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire.encode(ours))
    assert theirs.ts == 2.5 and theirs.data_parallel_rank == 0
    stored, pooled, removed, cleared = theirs.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 2**64 - 1]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(32))
    assert (stored.block_size, stored.medium, stored.lora_name) == (16, "GPU", None)
    assert isinstance(pooled, BlockStored) and pooled.ownership == "pool:x"
    assert pooled.parent_block_hash == 11
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_our_decoder_reads_vllms_batches() -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    batch = KVEventBatch(ts=1.0, events=[BlockStored(block_hashes=[5], parent_block_hash=None,
                         token_ids=[1, 2], block_size=2, lora_id=None, medium="GPU",
                         lora_name=None)], data_parallel_rank=0)  # fmt: skip
    ours = wire.decode(msgspec.msgpack.Encoder().encode(batch))
    assert ours.events == (wire.BlockStored((5,), None, (1, 2), 2, "GPU"),)
