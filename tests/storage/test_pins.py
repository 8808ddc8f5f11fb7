"""Pins on real folders: kept from eviction (a control run without the pin loses the pages),
persisted across restarts and binding every backend on the folder, expiring, capped."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pools import NAMESPACE, SMALL, Pool, new_hashes, refs

from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.disk.disk_pins import PINS_DIR, PinLimitError

Backends = Callable[..., DiskBackend]
ROOT = b"r" * 16
FILE = DiskConfig(Path("/unused"), NAMESPACE, SMALL, 1).page_file_bytes  # bytes of one page file


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[Backends]:
    opened: list[DiskBackend] = []

    def make(pages: int = 10, namespace: bytes = NAMESPACE, **kw: object) -> DiskBackend:
        cfg = DiskConfig(tmp_path / "kv", namespace, SMALL, pages * FILE, **kw)  # type: ignore[arg-type]
        opened.append(DiskBackend(cfg))
        assert opened[-1].wait_ready(10)
        return opened[-1]

    yield make
    for b in opened:
        b.close()


def churn(disk: DiskBackend, pool: Pool, rounds: int = 4) -> None:
    """A workload that fills the room pins leave (6 of 10 pages) several times over."""
    for _ in range(rounds):
        fresh = new_hashes(6)
        assert disk.put(refs(fresh, range(6)), pool.array) == 6


@pytest.mark.parametrize("pinned", [False, True], ids=["control", "pinned"])
def test_a_pinned_chain_outlives_a_workload_that_evicts_everything_else(
    backends: Backends, make_pool: Callable[..., Pool], pinned: bool
) -> None:
    pool = make_pool(10, fill=10)
    disk = backends(pages=10)
    system = new_hashes(3)
    disk.put(refs(system, range(3)), pool.array)
    if pinned:
        result = disk.pin(system, ROOT, "tenant-a", ttl_s=3600)
        assert result.pages_present == 3 and result.limit.pinned_bytes == 3 * FILE
    churn(disk, pool)
    assert disk.exists(system) == (3 if pinned else 0)
    if pinned:  # the rest of the folder turned over; the folder stayed within its size
        assert disk.stats().bytes_used <= 10 * FILE and disk.stats().extra["pinned_pages"] == 3


def test_pins_survive_a_restart_and_bind_every_backend_on_the_folder(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(10, fill=10)
    first = backends()
    system = new_hashes(4)
    first.put(refs(system, range(4)), pool.array)
    first.pin(system, ROOT, ttl_s=None)
    first.close()
    again = backends()  # a restart: the pin is a file in the folder
    [pin] = again.pins.active()
    assert pin.pages == tuple(system) and pin.root == ROOT and pin.expires_at is None
    other = backends()  # a second service on the same folder honours it as well
    churn(other, pool)
    assert other.exists(system) == 4 and again.exists(system) == 4
    assert again.unpin([pin.pin_id]) == 1
    churn(other, pool)
    assert other.exists(system) == 0


def test_a_pin_expires_after_its_ttl(backends: Backends, make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(10, fill=10)
    disk = backends()
    system = new_hashes(2)
    disk.put(refs(system, range(2)), pool.array)
    pin = disk.pin(system, ROOT, ttl_s=0.5).pin
    pin_file = disk.config.folder / PINS_DIR / f"{pin.pin_id}.pin"
    assert json.loads(pin_file.read_text())["expires_at"] == pytest.approx(time.time() + 0.5, 1)
    time.sleep(0.6)
    assert disk.pins.active() == [] and not pin_file.exists()
    churn(disk, pool)
    assert disk.exists(system) == 0


def test_pins_past_the_cap_are_refused_with_the_numbers(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    disk = backends(pages=10, max_pinned_fraction=0.5)  # 5 pages may be pinned
    a, b = new_hashes(4), new_hashes(2)
    disk.pin(a, ROOT)
    with pytest.raises(PinLimitError, match="--max-pinned-fraction allows") as refused:
        disk.pin(b, ROOT)
    assert refused.value.would_pin == 6 * FILE and refused.value.limit_bytes == 5 * FILE
    assert [p.pages for p in disk.pins.active()] == [tuple(a)]  # nothing written
    disk.pin(a, ROOT, ttl_s=60)  # re-pinning the same chain replaces it: not counted twice
    disk.pin([*a[:3], b[0]], ROOT)  # shares three pages with `a`: one page more
    assert disk.pin_usage().pinned_bytes == 5 * FILE
    other_ns = backends(pages=10, namespace=b"other\x1fns")
    with pytest.raises(PinLimitError):  # the cap is the folder's, every namespace's pins
        other_ns.pin(new_hashes(1), ROOT)


def test_a_damaged_pin_file_is_skipped(backends: Backends) -> None:
    disk = backends()
    disk.pin(new_hashes(2), ROOT)
    (disk.config.folder / PINS_DIR / "bad.pin").write_text("{not json")
    assert len(disk.pins.active()) == 1
