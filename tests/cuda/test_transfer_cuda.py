"""L1 (GPU) <-> L2 (pinned shared memory) copies on a side stream: bytes and bandwidth."""

from __future__ import annotations

import random
import time

import pytest
import torch
from cuda_marks import ON_CUDA

from asynchicache.bench.micro.l1_l2_copies import measure
from asynchicache.hierarchy.l2.transfer import TransferDone, TransferEngine
from asynchicache.hierarchy.pools import HostPool, KVLayout

pytestmark = ON_CUDA

CUDA = torch.device("cuda")


def _polled(engine: TransferEngine, ticket: int, timeout_s: float = 30.0) -> TransferDone:
    """Poll (as the cache does each step, never blocking) until `ticket` is reported."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for done in engine.poll():
            if done.ticket == ticket:
                return done
        time.sleep(0.001)
    raise AssertionError(f"copy {ticket} not reported within {timeout_s} s")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_through_pinned_l2_on_a_side_stream(dtype: torch.dtype) -> None:
    layout = KVLayout(4, 2, 64, 16, dtype)
    l1 = torch.zeros(64, *layout.page_shape, device=CUDA, dtype=dtype)
    l2 = HostPool.create(layout, 48, pin_memory=True, tag="cuda-test")
    engine = TransferEngine(CUDA)
    try:
        assert l2.pinned and l2.tensor is not None
        gen = torch.Generator(device=CUDA).manual_seed(0)
        # Written on the compute stream just before the copy is submitted: the side stream
        # must wait for it (a copy that did not would read zeros).
        l1.copy_(torch.randn(l1.shape, generator=gen, device=CUDA).to(dtype))
        src = random.Random(1).sample(range(64), 40)
        slots = random.Random(2).sample(range(48), 40)
        done = _polled(engine, engine.submit(l1, src, l2.tensor, slots))
        assert done.error is None and done.num_pages == 40
        assert done.num_bytes == 40 * layout.page_bytes
        host_l1 = l1.to("cpu", copy=True)
        for s, d in zip(src, slots, strict=True):
            assert torch.equal(l2.tensor[d], host_l1[s])
        back = [(p + 7) % 64 for p in src]  # into other L1 pages
        done = _polled(engine, engine.submit(l2.tensor, slots, l1, back))
        assert done.error is None
        for s, d in zip(src, back, strict=True):
            assert torch.equal(l1[d].cpu(), host_l1[s])
    finally:
        engine.close()
        l2.close()


def test_copies_run_near_torchs_pinned_copy() -> None:
    """GB/s of our L1 <-> L2 copies against one torch copy_ of the same bytes through
    pinned memory (the PCIe/NVLink bound): the issue's bar is 0.8x; here a generous 0.5x
    (gpu-check.sh records the real ratio from `bench engine`)."""
    result = measure(KVLayout(30, 3, 64, 16), pages=256, repeats=3, device=CUDA)
    assert result["bytes_equal"] and result["l2_pinned"], result
    assert result["l1_to_l2_vs_torch"] >= 0.5, result
    assert result["l2_to_l1_vs_torch"] >= 0.5, result
