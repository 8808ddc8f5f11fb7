"""KV events of every tier in one stream (kv_events/publisher.py), with a real cache service
(in a thread, real files, real sockets): a subscriber rebuilds what each tier holds, a late
or disconnected one detects the gap and catches up from the replay socket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from kv_rig import Rig, kv_rig

from asynchicache.kv_events import wire
from asynchicache.kv_events.subscriber import KvEventSubscriber

DISK_PAGES = 12  # the folder's capacity, in page files: the workload evicts


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with kv_rig(tmp_path, disk_pages=DISK_PAGES) as made:
        yield made


def test_a_subscriber_rebuilds_every_tier(rig: Rig) -> None:
    sub = KvEventSubscriber(rig.endpoint, rig.replay)
    try:
        sub.request_replay()  # answered by the publisher's next tick
        for k in range(0, 30, 3):  # 30 pages through L1 of 6, L2 of 8, a disk of 12
            rig.put(k, k + 1, k + 2)
            rig.publisher.tick()
            sub.poll(0)
        rig.cache.clear_tiers(device=True, host=False)
        rig.put(0, 1)  # again: from the disk (a load) or computed anew
        rig.quiet(sub)
        truth = rig.truth()
        assert sub.counts() == truth, (sub.counts(), truth)
        assert truth["disk"] == DISK_PAGES and truth["host"] > 0 and truth["device"] > 0
        assert sub.gaps == 0 and sub.replays == 1
        listed = rig.client.contents(("disk",))  # type: ignore[union-attr]
        on_disk = {wire.external_hash(h) for h in listed.disk_hashes}  # type: ignore[union-attr]
        assert sub.tiers["disk"] == on_disk
    finally:
        sub.close()


def test_a_gap_is_detected_and_the_replay_recovers(rig: Rig) -> None:
    sub = KvEventSubscriber(rig.endpoint, rig.replay)
    try:
        sub.request_replay()
        rig.put(1, 2)
        rig.quiet(sub)
        sub.disconnect()  # the router is away: what is published now is lost to it
        for k in range(10, 30, 2):
            rig.put(k, k + 1)
            rig.publisher.tick()
        sub.connect()
        time.sleep(0.3)  # the new subscription takes hold
        rig.put(40, 41)
        rig.quiet(sub)
        assert sub.gaps >= 1 and sub.replays >= 2, (sub.gaps, sub.replays)
        assert sub.counts() == rig.truth()
    finally:
        sub.close()


def test_a_subscriber_that_joins_gets_every_tier_without_asking(rig: Rig) -> None:
    """vllm-router asks for a replay only on a gap: one that (re)starts would otherwise
    learn nothing of what was stored before it joined. The publisher hears the
    subscription (XPUB) and resyncs: `AllBlocksCleared`, then every tier's contents."""
    for k in range(0, 12, 3):
        rig.put(k, k + 1, k + 2)
        rig.publisher.tick()
    first = KvEventSubscriber(rig.endpoint, rig.replay)
    try:
        first.request_replay()
        rig.quiet(first)  # every store has reached the disk and been published
    finally:
        first.close()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(rig.endpoint)
    try:
        held: dict[str, set[int]] = {}
        deadline = time.monotonic() + 10
        while not any(isinstance(e, wire.AllBlocksCleared) for e in _events(sub, held)):
            assert time.monotonic() < deadline, "no resync for the new subscriber"
            rig.publisher.tick()
        for _ in range(5):  # the rest of the resync's batches
            rig.publisher.tick()
            _events(sub, held)
        truth = rig.truth()
        assert {t: len(held.get(t, ())) for t in truth} == truth, (held, truth)
    finally:
        sub.close(linger=0)
        ctx.term()


def _events(sub: zmq.Socket, held: dict[str, set[int]]) -> list[wire.Event]:
    """The batches waiting on `sub`, applied to `held` (hashes by tier); their events."""
    out: list[wire.Event] = []
    while sub.poll(100):
        _, _, payload = sub.recv_multipart()
        for e in wire.decode(payload).events:
            out.append(e)
            if isinstance(e, wire.AllBlocksCleared):
                held.clear()
            elif isinstance(e, wire.BlockStored):
                held.setdefault(wire.TIER_OF_MEDIUM[e.medium], set()).update(e.block_hashes)
            else:
                held.setdefault(wire.TIER_OF_MEDIUM[e.medium], set()).difference_update(
                    e.block_hashes
                )
    return out
