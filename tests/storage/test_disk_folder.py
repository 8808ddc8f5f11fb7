"""One folder, several namespaces: the capacity counts them all, and pages of a namespace no
live server leases (what an upgrade leaves behind) are evicted before any live page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pools import NAMESPACE, SMALL, Pool, new_hashes, refs

from asynchicache.storage.disk.disk_admin import folder_stats
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig, namespace_dir_name
from asynchicache.storage.header import header_len_for

OLD = b"test-model\x1ffloat32\x1f4\x1f1\x1f"  # what an upgrade leaves behind
NEW = NAMESPACE + b"\x1fasynchicache\x1f1"

Open = Callable[..., DiskBackend]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def open_disk(root: Path) -> Iterator[Open]:
    opened: list[DiskBackend] = []

    def make(namespace: bytes, capacity: int = 1 << 30) -> DiskBackend:
        opened.append(DiskBackend(DiskConfig(root, namespace, SMALL, capacity)))
        assert opened[-1].wait_ready(10)
        return opened[-1]

    yield make
    for d in opened:
        d.close()


def _pages(root: Path, namespace: bytes) -> int:
    return sum(1 for _ in (root / namespace_dir_name(namespace)).rglob("*.kv"))


def _file_bytes() -> int:
    """One page file of either namespace (the same: headers are 4096-byte blocks)."""
    sizes = {header_len_for(len(ns), 4, SMALL) + SMALL.page_bytes for ns in (OLD, NEW)}
    assert len(sizes) == 1
    return sizes.pop()


def test_an_unused_namespace_is_evicted_first_and_oldest_first(
    root: Path, open_disk: Open, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8, fill=8)
    size = _file_bytes()
    old = open_disk(OLD)
    old_hashes = new_hashes(6)
    for i, h in enumerate(old_hashes):  # one put each: a clear age order
        old.put(refs([h], [i]), pool.array)
    old.close()  # the old server is gone: nobody leases OLD any more
    new = open_disk(NEW, capacity=8 * size)
    mine = new_hashes(4)
    assert new.put(refs(mine, range(4)), pool.array) == 4
    # 6 old + 4 new > 8: the two oldest old pages made room, no page of ours went.
    gone = [h for h in old_hashes if not old.path_of(h).exists()]
    assert gone == old_hashes[:2]
    assert new.exists(mine) == 4 and new.stats().evictions == 0
    more = new_hashes(4)
    assert new.put(refs(more, range(4, 8)), pool.array) == 4
    assert _pages(root, OLD) == 0 and new.exists(mine) == 4 and new.exists(more) == 4
    assert folder_stats(root).bytes <= 8 * size
    assert new.stats().extra.get("stale_namespace_evictions") == 6


def test_a_new_start_trims_what_an_upgrade_left_over_capacity(
    root: Path, open_disk: Open, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(10)
    size = _file_bytes()
    old = open_disk(OLD)
    old.put(refs(new_hashes(10), range(10)), pool.array)
    old.close()
    new = open_disk(NEW, capacity=6 * size)
    assert new.stats().pages == 0
    assert _pages(root, OLD) == 6  # the folder is within capacity before any store
    assert folder_stats(root).bytes == 6 * size


def test_a_live_namespace_is_counted_but_never_evicted_by_another(
    root: Path, open_disk: Open, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8)
    size = _file_bytes()
    other = open_disk(OLD)  # still served (another model on the same folder)
    theirs = new_hashes(4)
    other.put(refs(theirs, range(4)), pool.array)
    mine = open_disk(NEW, capacity=6 * size)
    first = new_hashes(2)
    assert mine.put(refs(first, range(2)), pool.array) == 2
    second = new_hashes(2)
    assert mine.put(refs(second, range(2, 4)), pool.array) == 2
    # 4 of theirs + 2 of ours fill the folder: our own oldest pages made room.
    assert other.exists(theirs) == 4 and all(other.path_of(h).exists() for h in theirs)
    assert mine.exists(first) == 0 and mine.exists(second) == 2
    assert mine.stats().evictions == 2
    assert mine.stats().extra.get("other_namespaces_bytes") == 4 * size
    report = {ns.folder: ns.in_use for ns in folder_stats(root).namespaces}
    assert report == {namespace_dir_name(OLD): True, namespace_dir_name(NEW): True}


HOLD = """
import sys, time
from pathlib import Path
from asynchicache.storage.disk.folder import NamespaceLease
lease = NamespaceLease(Path(sys.argv[1]))
print("held", lease.held, flush=True)
time.sleep(600)
"""


def test_a_killed_server_leaves_no_lease_behind(root: Path) -> None:
    from asynchicache.storage.disk.folder import in_use

    folder = root / namespace_dir_name(OLD)
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held True"
        assert in_use(folder)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert not in_use(folder)  # the kernel dropped the lock with the process


def test_cache_stats_shows_which_namespaces_are_in_use(
    root: Path, open_disk: Open, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(2)
    open_disk(NEW).put(refs(new_hashes(1), [0]), pool.array)
    old = open_disk(OLD)
    old.put(refs(new_hashes(1), [1]), pool.array)
    old.close()
    out = subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", "stats", "--disk-cache-dir", str(root),
         "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    used = {ns["folder"]: ns["in_use"] for ns in json.loads(out.stdout)["namespaces"]}
    assert used == {namespace_dir_name(NEW): True, namespace_dir_name(OLD): False}
