"""The engine loop while idle: background cache work that lands then is released (issue 11).

Defect 2: the idle loop polled the cache itself and dropped the load tickets
it returned, so a load given up earlier that landed while the engine was idle
kept its pages locked in L1 and L2 for good.
"""

from __future__ import annotations

import pytest
from loop_harness import LoopHarness
from storage_doubles import MemoryStorage

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
TEXT = "The harbour master counted the boats that came in with the tide each morning. "


def assert_nothing_locked(engine: Engine) -> None:
    engine.cache.check_integrity()
    for node in engine.cache.tree.iter_nodes():
        assert node.lock_ref == 0, f"a lock nobody holds at {node}"
        assert node.host_ref == 0, f"a store hold left at {node}"


@pytest.mark.slow
def test_a_given_up_load_landing_while_idle_leaves_nothing_locked(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    prompt = tok.encode(TEXT * 8)
    cache = CacheConfig(
        disk_cache_dir=None,
        host_cache_gb=0.25,
        prefetch_policy="timeout",
        prefetch_timeout_s=1e-9,
    )
    storage = MemoryStorage(None)
    engine = Engine(EngineConfig(), cache, storage=storage, loaded=smollm)
    storage.pool = engine.cache.host_pool
    try:
        engine.generate([prompt], ONE)
        engine.cache.drain()  # stored below L2
        engine.cache.clear()
        assert engine.cache.lookup(prompt)["disk"] > 0
        storage.hold = True
        storage.cancellable = False  # the read has started: it lands later
        harness = LoopHarness(engine)
        try:
            out = harness.generate([prompt], ONE)[0]
            assert out.finish_reason == "length" and out.cached.disk == 0  # given up
            storage.hold = False  # the load lands while the engine is idle
            harness.wait_quiet()
            cleared = harness.admin("clear", tiers=("device", "host"))
            stats = harness.admin("stats")["cache"]
        finally:
            harness.stop()
        assert stats["device"]["cached"] == 0 and stats["host"]["cached"] == 0, (
            f"pages stayed locked after clear: {stats['device']}, {stats['host']}"
        )
        assert cleared["cleared"] > 0, "the given-up load never landed: the test proves nothing"
        assert_nothing_locked(engine)
    finally:
        engine.close()
