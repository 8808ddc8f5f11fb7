"""What one scheduler step puts in a batch (tiny cache, no model)."""

from __future__ import annotations

from scheduler_rig import PAGE, RigMaker, tokens_for

from asynchicache.config import EngineConfig
from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.request import Request


def test_a_step_prefills_several_requests_up_to_max_prefill_tokens(make_rig: RigMaker) -> None:
    config = EngineConfig(
        min_load_tokens=0, chunked_prefill_size=3 * PAGE, max_prefill_tokens=8 * PAGE
    )
    rig = make_rig(device_pages=64, engine=config)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for k in range(4):
        rig.scheduler.add(Request(f"r{k}", tokens_for(*range(10 * k, 10 * k + 5)), one))
    batch = rig.scheduler.schedule()
    # Each request gets at most one chunk, all of them at most max_prefill_tokens.
    assert [s.num_new for s in batch.seqs] == [3 * PAGE, 3 * PAGE, 2 * PAGE]
