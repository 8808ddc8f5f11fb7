"""Page layout, the L1 pool and the shared-memory L2 pool (with real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asynchicache.common.shm import SHM_DIR, SharedSegment, list_segments
from asynchicache.hierarchy.pools import DevicePool, HostPool, KVLayout
from tests.support.settling import wait_until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, page_size=4, dtype=torch.float32)


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = HostPool.create(LAYOUT, 6)
    yield p
    p.close()


def _run_child(script: str, *args: str) -> str:
    code = "import torch\nfrom asynchicache.hierarchy.pools import HostPool, KVLayout\n"
    code += "LAYOUT = KVLayout(2, 3, 4, 4, torch.float32)\n" + textwrap.dedent(script)
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_layout_shapes_and_bytes() -> None:
    assert LAYOUT.page_shape == (2, 2, 4, 3, 4)
    assert LAYOUT.page_numel == 2 * 2 * 4 * 3 * 4
    assert LAYOUT.page_bytes == LAYOUT.page_numel * 4
    bf16 = KVLayout(30, 3, 64, 16, torch.bfloat16)
    assert bf16.page_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert bf16.pages_in(bf16.page_bytes * 5 + 1) == 5
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, 1, dtype="float32")  # type: ignore[arg-type]


def test_device_pool_layout() -> None:
    pool = DevicePool(LAYOUT, 5, torch.device("cpu"))
    assert pool.tensor.shape == (5, 2, 2, 4, 3, 4)
    assert pool.num_pages == 5
    pool.tensor[3, 1].fill_(7.0)
    assert pool.layer(1)[3].eq(7.0).all()
    assert pool.layer(1).shape == (5, 2, 4, 3, 4)


def test_host_pool_views_share_memory(pool: HostPool) -> None:
    assert pool.tensor is not None and pool.slots is not None
    assert pool.tensor.shape == (6, *LAYOUT.page_shape)
    assert pool.slots.shape == (6, LAYOUT.page_bytes)
    pool.tensor[2].fill_(1.5)
    raw = pool.slots[2].view("<f4")
    assert (raw == 1.5).all()
    assert (SHM_DIR / pool.name).stat().st_size == 6 * LAYOUT.page_bytes
    assert pool.segment.owner and pool.num_slots == 6


def test_second_process_reads_and_writes_the_pool(pool: HostPool) -> None:
    assert pool.tensor is not None
    values = torch.arange(LAYOUT.page_numel, dtype=torch.float32)
    pool.tensor[1].copy_(values.view(LAYOUT.page_shape))
    out = _run_child(
        """
        import sys
        other = HostPool.attach(sys.argv[1], LAYOUT)
        assert not other.segment.owner and other.num_slots == 6
        print(float(other.tensor[1].sum()))
        other.tensor[4].fill_(3.25)
        other.close()
        """,
        pool.name,
    )
    n = LAYOUT.page_numel
    assert float(out) == n * (n - 1) / 2
    assert pool.tensor[4].eq(3.25).all()


def test_attached_process_exit_keeps_the_segment(pool: HostPool) -> None:
    assert pool.tensor is not None
    pool.tensor[0].fill_(2.0)
    # The child exits without closing, the way a crashed service would.
    _run_child(
        """
        import os, sys
        other = HostPool.attach(sys.argv[1], LAYOUT)
        other.tensor[5].fill_(9.0)
        os._exit(0)
        """,
        pool.name,
    )
    assert (SHM_DIR / pool.name).exists()
    assert pool.tensor[5].eq(9.0).all() and pool.tensor[0].eq(2.0).all()
    out = _run_child(
        """
        import sys
        other = HostPool.attach(sys.argv[1], LAYOUT)
        print(float(other.tensor[0][0, 0, 0, 0, 0]))
        other.close()
        """,
        pool.name,
    )
    assert float(out) == 2.0


def test_segment_of_a_dead_owner_is_removed_at_next_create() -> None:
    name = _run_child(
        """
        import os
        p = HostPool.create(LAYOUT, 2)
        print(p.name, flush=True)
        os._exit(0)  # dies without unlinking
        """
    )
    assert name in list_segments()
    fresh = HostPool.create(LAYOUT, 2)
    try:
        assert name not in list_segments()
        assert fresh.name in list_segments()
    finally:
        fresh.close()
    assert fresh.name not in list_segments()


def test_attach_rejects_a_mismatched_layout(pool: HostPool) -> None:
    odd = KVLayout(num_layers=3, num_kv_heads=5, head_dim=7, page_size=4)
    with pytest.raises(ValueError, match="wrong layout"):
        HostPool.attach(pool.name, odd)


def test_close_unlinks_and_is_idempotent() -> None:
    p = HostPool.create(LAYOUT, 1)
    path = Path(SHM_DIR / p.name)
    p.close()
    p.close()
    assert not path.exists()


def test_a_new_segment_is_reserved_in_tmpfs_soon_after_creation() -> None:
    """The owner allocates every page of the segment up front (in the background), so a
    load's first reads into fresh slots pay no page faults."""
    size = 64 << 20
    segment = SharedSegment.create(size, tag="reserve-test")
    try:
        path = SHM_DIR / segment.name
        wait_until(lambda: path.stat().st_blocks * 512 >= size, "the segment reserved", 30)
    finally:
        segment.close()


def test_a_segment_bigger_than_shm_fails_at_creation_with_a_clear_error() -> None:
    """Not SIGBUS on first touch later: the room is checked when the pool is made."""
    fs = os.statvfs(SHM_DIR)
    too_big = fs.f_bavail * fs.f_frsize + (1 << 30)
    before = set(list_segments())
    with pytest.raises(OSError, match="does not fit in /dev/shm"):
        SharedSegment.create(too_big, tag="too-big")
    assert set(list_segments()) == before
