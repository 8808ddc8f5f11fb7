"""vLLM's KV event stream (`--kv-events-config`) carries what our tiers store and evict.

vLLM's real scheduler (sched_harness.py) publishes its events on a ZeroMQ PUB
socket; this test subscribes as a router would and decodes them: the pages a
request saved appear as BlockStored with medium CPU (our L2) and DISK (the
cache service stored them), named by our page hashes' low 64 bits with their tokens, and
pages evicted from L2 as BlockRemoved with medium CPU. On main the connector
reported nothing (only vLLM's own GPU blocks appeared).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from sched_harness import PAGE, Engine, Truth, tiny_model_folder

from asynchicache.integrations.vllm.block_lookup import RequestChain
from asynchicache.kv_events.wire import external_hash

pytestmark = pytest.mark.timeout(600)


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def until(self, done: Callable[[list], bool], timeout_s: float = 60.0) -> list:
        """Receive until `done(events so far)` (vLLM publishes from a thread of its own)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.events):
            if time.monotonic() > deadline:
                raise AssertionError(f"events so far: {self.events}")
            if self.sock.poll(100):
                _, _, payload = self.sock.recv_multipart()
                self.events += self.decoder.decode(payload).events
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def engine_and_events(tmp_path: Path) -> Iterator[tuple[Engine, Subscriber]]:
    endpoint = f"ipc://{tmp_path}/events.sock"
    model = tiny_model_folder(tmp_path / "model")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    # An L2 of 20 pages: a few prompts evict each other's pages.
    made = Engine(
        model, tmp_path / "root", kv_events=config, extra={"host_cache_gb": 170_000 / 2**30}
    )
    sub = Subscriber(endpoint)
    time.sleep(0.3)  # a SUB socket misses what is published before it joined
    yield made, sub
    sub.close()
    made.shutdown()


def ours(events: list, medium: str, kind: str) -> set[int]:
    """Our events' block hashes (vLLM's own go out as medium GPU)."""
    return {h for e in events if type(e).__name__ == kind and e.medium == medium
            for h in e.block_hashes}  # fmt: skip


def test_stored_and_evicted_pages_reach_vllms_event_stream(
    engine_and_events: tuple[Engine, Subscriber],
) -> None:
    engine, sub = engine_and_events
    assert engine.side.index.num_slots == 20
    rng = random.Random(5)
    prompt = [rng.randrange(1, 900) for _ in range(6 * PAGE + 3)]
    engine.add("first", Truth(prompt, [5, 6]), max_tokens=2)
    engine.run()
    engine.settle()
    engine.add("poke", Truth([3, 4, 5], [6]), max_tokens=1)  # a step hands over new events
    engine.run()
    pages = RequestChain(engine.side.namespace.digest(), PAGE).extend(prompt)
    chain = {external_hash(h) for h in pages}
    events = sub.until(
        lambda ev: (
            ours(ev, "CPU", "BlockStored") >= chain and ours(ev, "DISK", "BlockStored") >= chain
        )
    )
    first = external_hash(pages[0])
    stored = next(e for e in events if e.medium == "CPU" and first in e.block_hashes)
    assert stored.block_size == PAGE and stored.token_ids[:PAGE] == prompt[:PAGE]
    assert stored.parent_block_hash is None  # the chain's first page
    # Other prompts push the first one's pages out of the 20-page L2.
    for i in range(3):
        other = [rng.randrange(1, 900) for _ in range(8 * PAGE + 1)]
        engine.add(f"other-{i}", Truth(other, [5]), max_tokens=1)
        engine.run()
        engine.settle()
    engine.add("poke-2", Truth([3, 4, 5], [6]), max_tokens=1)
    engine.run()
    sub.until(lambda ev: ours(ev, "CPU", "BlockRemoved") >= chain)
