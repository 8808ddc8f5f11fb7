"""Our KV events are vLLM's: vLLM 0.32's own msgspec decoder (the type its publisher
encodes, and llm-d's and Dynamo's subscribers mirror) reads our payload, with every
field in place; and our decoder reads what vLLM's encoder writes."""

from __future__ import annotations

import msgspec
import pytest

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


def _connector_batch(storage_ownership: str | None) -> bytes:
    """The connector's events for one stored chain (L2, then the service), encoded as
    vLLM's publisher encodes a batch (its msgspec encoder, ZmqEventPublisher)."""
    from vllm.distributed.kv_events import KVEventBatch

    from asynchicache.integrations.vllm.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVEventLog
    from asynchicache.storage.base import PageRef

    root, first, second = b"r" * 16, b"a" * 16, b"b" * 16
    pages = [PageRef(first, (1, 2), 0, root), PageRef(second, (3, 4), 1, first)]
    log = KVEventLog(True, 2, storage_ownership)
    log.stored(pages, MEDIUM_CPU, root)
    log.stored(pages, MEDIUM_STORAGE, root)
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=log.take()))


def test_the_connectors_shared_storage_pages_carry_the_pool() -> None:
    """kv_events_shared_disk (or remote_url): the service's pages (DISK) go out as the
    pool's, in vLLM's own struct, which vLLM's decoder and every router's read back;
    L2 pages (CPU) stay this instance's."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    payload = _connector_batch("pool:fleet")
    assert msgspec.msgpack.decode(payload)[0] == 1.0  # array-like: [ts, events, dp rank]
    theirs = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    host, stored = theirs.events
    assert isinstance(host, BlockStored) and isinstance(stored, BlockStored)
    assert (host.medium, host.ownership) == ("CPU", None)
    assert (stored.medium, stored.ownership) == ("DISK", "pool:fleet")
    assert stored.parent_block_hash is None and stored.token_ids == [1, 2, 3, 4]
    ours = wire.decode(payload)  # what our subscriber (a router's side) reads
    assert [(e.medium, e.ownership) for e in ours.events] == [
        ("CPU", None),
        ("DISK", "pool:fleet"),
    ]
    unshared = msgspec.msgpack.Decoder(type=KVEventBatch).decode(_connector_batch(None))
    assert [e.ownership for e in unshared.events] == [None, None]


def test_the_connectors_storage_is_the_pools_when_shared_or_written_to_l4() -> None:
    from asynchicache.integrations.vllm.connector_config import ConnectorConfig
    from asynchicache.kv_events.publisher import DEFAULT_POOL

    assert ConnectorConfig.from_extra({}).storage_ownership is None
    shared = ConnectorConfig.from_extra({"kv_events_shared_disk": "true"})
    assert shared.storage_ownership == DEFAULT_POOL == "pool:asynchicache"
    remote = ConnectorConfig.from_extra({"remote_url": "redis://127.0.0.1:1/0"})
    assert remote.storage_ownership == DEFAULT_POOL
    named = {"kv_events_shared_disk": True, "kv_events_pool": "pool:team-a"}
    assert ConnectorConfig.from_extra(named).storage_ownership == "pool:team-a"
    with pytest.raises(ValueError, match="kv_events_pool"):
        ConnectorConfig.from_extra({"kv_events_pool": ""})
