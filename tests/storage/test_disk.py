"""DiskBackend on real files: round trips, restarts, damage of every kind, capacity, LRU."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from pools import ALIGNED, NAMESPACE, SMALL, Pool, new_hashes, refs

from asynchicache.common import fileio
from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.disk import disk_backend as disk_module
from asynchicache.storage.disk import write as disk_write
from asynchicache.storage.disk.disk_backend import TMP_PREFIX, DiskBackend, DiskConfig
from asynchicache.storage.header import decode_header

Backends = Callable[..., DiskBackend]


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[Backends]:
    opened: list[DiskBackend] = []

    def make(
        layout: PageLayout = SMALL,
        capacity: int = 1 << 30,
        root: Path | None = None,
        namespace: bytes = NAMESPACE,
        **kw: object,
    ) -> DiskBackend:
        cfg = DiskConfig(root or tmp_path / "kv", namespace, layout, capacity, **kw)  # type: ignore[arg-type]
        opened.append(DiskBackend(cfg))
        return opened[-1]

    yield make
    for b in opened:
        b.close()


@pytest.mark.parametrize("layout", [SMALL, ALIGNED], ids=["buffered", "direct"])
def test_put_get_round_trip(backends: Backends, make_pool: Callable[..., Pool], layout) -> None:
    pool = make_pool(16, layout, fill=8)
    disk = backends(layout)
    hashes = new_hashes(8)
    assert disk.put(refs(hashes, range(8)), pool.array) == 8
    assert disk.exists(hashes) == 8
    assert disk.get(hashes, list(range(8, 16)), pool.array) == 8
    assert np.array_equal(pool.array[8:16], pool.array[0:8])
    s = disk.stats()
    assert (s.pages, s.pages_written, s.pages_read, s.hits, s.corrupt_detected) == (8, 8, 8, 8, 0)
    direct = 8.0 if layout is ALIGNED else 0.0  # /tmp is ext4: O_DIRECT when aligned
    assert s.extra.get("direct_reads", 0.0) == s.extra.get("direct_writes", 0.0) == direct


def test_files_are_private_and_self_describing(
    backends: Backends, make_pool: Callable[..., Pool], tmp_path: Path
) -> None:
    pool = make_pool(2)
    disk = backends()
    [h] = new_hashes(1)
    disk.put(refs([h], [0]), pool.array)
    path = disk.path_of(h)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert path.name == h.hex() + ".kv"
    assert path.read_bytes()[:8] == b"ACKVPAGE"


def test_page_file_names_its_parent(backends: Backends, make_pool: Callable[..., Pool]) -> None:
    """The header carries the hash a page was chained from (the deep audit rebuilds chains)."""
    pool = make_pool(2)
    disk = backends()
    root, first, second = new_hashes(3)
    disk.put([PageRef(first, (1, 2, 3, 4), 0, root), PageRef(second, (5, 6, 7, 8), 1, first)],
             pool.array)  # fmt: skip
    parents = [decode_header(disk.path_of(h).read_bytes()).parent for h in (first, second)]
    assert parents == [root, first]


@pytest.mark.parametrize("layout", [SMALL, ALIGNED], ids=["buffered", "direct"])
def test_restart_keeps_every_page(
    backends: Backends, make_pool: Callable[..., Pool], layout
) -> None:
    pool = make_pool(40, layout, fill=20, seed=3)
    first = backends(layout)
    hashes = new_hashes(20)
    first.put(refs(hashes, range(20)), pool.array)
    order = first.lru_order()
    first.close()
    second = backends(layout)
    assert second.wait_ready(5)
    assert second.exists(hashes) == 20
    assert second.stats().bytes_used == first.stats().bytes_used
    assert second.lru_order() == order  # file mtimes carry the LRU order across restarts
    assert second.get(hashes, list(range(20, 40)), pool.array) == 20
    assert np.array_equal(pool.array[20:40], pool.array[0:20])


def _damage_flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def _damage_flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[70] ^= 0x01  # inside the namespace field
    path.write_bytes(bytes(data))


def _damage_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _damage_append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"tail")


def _damage_delete(path: Path) -> None:
    path.unlink()


def _damage_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


DAMAGE = {
    "flipped-payload-byte": _damage_flip_payload,
    "flipped-header-byte": _damage_flip_header,
    "truncated": _damage_truncate,
    "trailing-bytes": _damage_append,
    "deleted": _damage_delete,
    "garbage": _damage_garbage,
}


@pytest.mark.parametrize("layout", [SMALL, ALIGNED], ids=["buffered", "direct"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_page_is_a_counted_miss(
    backends: Backends, make_pool: Callable[..., Pool], layout: PageLayout, damage: str
) -> None:
    pool = make_pool(8, layout, fill=4)
    disk = backends(layout)
    hashes = new_hashes(4)
    disk.put(refs(hashes, range(4)), pool.array)
    DAMAGE[damage](disk.path_of(hashes[2]))
    assert disk.get(hashes, [4, 5, 6, 7], pool.array) == 2  # the verified prefix
    assert np.array_equal(pool.array[4:6], pool.array[0:2])
    assert not disk.path_of(hashes[2]).exists()
    assert disk.exists(hashes) == 2
    s = disk.stats()
    assert s.corrupt_detected == 1 and s.hits == 2 and s.misses == 2
    # The page can be stored again and then reads back fine.
    assert disk.put(refs(hashes[2:3], [2]), pool.array) == 1
    assert disk.get(hashes, [4, 5, 6, 7], pool.array) == 4


def test_page_of_another_namespace_is_a_counted_miss(
    backends: Backends, make_pool: Callable[..., Pool], tmp_path: Path
) -> None:
    pool = make_pool(4, fill=2)
    ours = backends()
    theirs = backends(namespace=b"other-model")
    h_ours, h_theirs = new_hashes(2)
    ours.put(refs([h_ours], [0]), pool.array)
    theirs.put(refs([h_theirs], [1]), pool.array)
    assert ours.path_of(h_ours).parent.parent != theirs.path_of(h_theirs).parent.parent
    # A foreign file under our page's name (e.g. copied in by hand) is never served.
    ours.path_of(h_ours).write_bytes(theirs.path_of(h_theirs).read_bytes())
    assert ours.get([h_ours], [2], pool.array) == 0
    assert ours.stats().corrupt_detected == 1 and not ours.path_of(h_ours).exists()
    assert theirs.get([h_theirs], [3], pool.array) == 1  # the other namespace is untouched


def test_damage_found_by_the_start_up_scan(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(4)
    disk = backends()
    hashes = new_hashes(4)
    disk.put(refs(hashes, range(4)), pool.array)
    disk.close()
    _damage_garbage(disk.path_of(hashes[0]))
    _damage_truncate(disk.path_of(hashes[1]))
    again = backends()
    assert again.wait_ready(5)
    s = again.stats()
    assert s.corrupt_detected == 2 and s.pages == 2
    assert not disk.path_of(hashes[0]).exists() and not disk.path_of(hashes[1]).exists()


def test_capacity_evicts_suffix_first_in_lru_order(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8)
    probe = backends(root=None)
    a = new_hashes(3)
    probe.put(refs(a[:1], [0]), pool.array)
    file_size = probe.stats().bytes_used
    probe.clear()
    probe.close()
    disk = backends(capacity=4 * file_size)
    b = new_hashes(3)
    assert disk.put(refs(a, range(3)), pool.array) == 3
    assert disk.put(refs(b[:1], [3]), pool.array) == 1
    assert disk.lru_order() == [a[2], a[1], a[0], b[0]]
    assert disk.get(a[:1], [4], pool.array) == 1  # a0 used again: most recent
    assert disk.put(refs(b[1:], [5, 6]), pool.array) == 2
    # Victims: a2 (suffix of a) then a1; the prefix a0 stays with b.
    assert disk.exists(a) == 1
    assert disk.lru_order() == [b[0], a[0], b[2], b[1]]
    s = disk.stats()
    assert s.evictions == 2 and s.bytes_used == 4 * file_size and s.pages == 4
    assert not disk.path_of(a[2]).exists() and not disk.path_of(a[1]).exists()


def test_capacity_counts_what_is_already_on_disk(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(10)
    disk = backends()
    hashes = new_hashes(10)
    disk.put(refs(hashes, range(10)), pool.array)
    file_size = disk.stats().bytes_used // 10
    disk.close()
    smaller = backends(capacity=6 * file_size)
    assert smaller.wait_ready(5)
    assert smaller.stats().bytes_used == 6 * file_size
    # The chain was stamped prefix-newest, so its first six pages survive.
    assert smaller.exists(hashes) == 6
    assert sum(p.suffix == ".kv" for p in smaller.config.folder.rglob("*")) == 6


def test_a_page_larger_than_capacity_is_not_stored(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(2)
    disk = backends(capacity=100)
    assert disk.put(refs(new_hashes(2), [0, 1]), pool.array) == 0
    s = disk.stats()
    assert s.store_failures == 2 and s.bytes_used == 0


def test_reads_work_while_a_large_index_is_still_being_built(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(300, fill=300)
    disk = backends()
    hashes = new_hashes(300)
    disk.put(refs(hashes, range(300)), pool.array)
    disk.close()
    again = backends(scan_wait_s=0.0)
    # Whatever the scan has reached, a read of any page works and checks the file.
    assert again.get(hashes[-3:], [0, 1, 2], pool.array) == 3
    assert np.array_equal(pool.array[0:3], pool.array[297:300])
    assert again.wait_ready(10)
    assert again.exists(hashes) == 300 and again.stats().pages == 300


def test_stale_temp_files_are_removed_at_start(
    backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(1)
    disk = backends()
    [h] = new_hashes(1)
    disk.put(refs([h], [0]), pool.array)
    disk.close()
    sub = disk.path_of(h).parent
    stale, fresh = sub / f"{TMP_PREFIX}stale", sub / f"{TMP_PREFIX}fresh"
    stale.write_bytes(b"half a page")
    fresh.write_bytes(b"being written by a live process")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert backends().wait_ready(5)
    assert not stale.exists() and fresh.exists()


def test_clear_removes_only_page_files(backends: Backends, make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(4)
    disk = backends()
    hashes = new_hashes(4)
    disk.put(refs(hashes, range(4)), pool.array)
    keep = disk.config.folder / "README.txt"
    keep.write_text("not ours")
    assert disk.clear().removed == 4
    assert disk.exists(hashes) == 0 and disk.stats().bytes_used == 0 and keep.exists()


def test_bad_arguments_are_rejected(backends: Backends, make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(2)
    disk = backends()
    with pytest.raises(ValueError, match="slots out of range"):
        disk.get(new_hashes(1), [-1], pool.array)
    with pytest.raises(ValueError, match="pool must be"):
        disk.put(refs(new_hashes(1), [0]), pool.array.reshape(-1))
    with pytest.raises(ValueError, match="disk-cache-gb"):
        DiskConfig(Path("x"), NAMESPACE, SMALL, 0)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real full disk (we are root in CI; elsewhere this test cannot run)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs (needs root): {done.stderr.decode()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_fails_stores_cleanly_and_loads_keep_working(
    backends: Backends, make_pool: Callable[..., Pool], small_fs: Path
) -> None:
    layout = PageLayout("float32", (2, 2, 16, 2, 16))  # 8 KiB pages: ~120 fit in 1 MiB
    pool = make_pool(400, layout, fill=200)
    disk = backends(layout, capacity=1 << 30, root=small_fs)  # our limit is not what stops it
    hashes = new_hashes(200)
    stored = disk.put(refs(hashes, range(200)), pool.array)
    assert 0 < stored < 200
    s = disk.stats()
    assert s.store_failures == 200 - stored and s.pages == stored
    ok = [h for h in hashes if disk.exists([h])]
    assert len(ok) == stored
    slots = list(range(200, 200 + stored))
    assert disk.get(ok, slots, pool.array) == stored
    src = [hashes.index(h) for h in ok]
    assert np.array_equal(pool.array[slots], pool.array[src])
    assert not [p for p in small_fs.rglob(f"{TMP_PREFIX}*")]  # failed writes cleaned up


def test_falls_back_to_buffered_io_where_o_direct_is_refused(
    backends: Backends, make_pool: Callable[..., Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems (older tmpfs, FUSE) answer O_DIRECT with EINVAL."""

    def refuse(real: Callable[..., int]) -> Callable[..., int]:
        def wrapped(path: Path, direct: bool) -> int:
            if direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(path, direct)

        return wrapped

    monkeypatch.setattr(disk_write, "open_read", refuse(fileio.open_read))
    monkeypatch.setattr(disk_write, "create_private", refuse(fileio.create_private))
    pool = make_pool(8, ALIGNED, fill=4)
    disk = backends(ALIGNED)
    hashes = new_hashes(4)
    assert disk.put(refs(hashes, range(4)), pool.array) == 4
    assert disk.get(hashes, [4, 5, 6, 7], pool.array) == 4
    assert np.array_equal(pool.array[4:8], pool.array[0:4])
    s = disk.stats()
    assert "direct_reads" not in s.extra or s.extra["direct_reads"] == 0
    assert s.store_failures == 0 and s.corrupt_detected == 0


def test_reads_carry_lru_order_across_restarts(
    backends: Backends, make_pool: Callable[..., Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool(8)
    disk = backends()
    a, b = new_hashes(2), new_hashes(2)
    disk.put(refs(a, [0, 1]), pool.array)
    disk.put(refs(b, [2, 3]), pool.array)
    mtime = disk.path_of(a[0]).stat().st_mtime_ns
    assert disk.get(a, [4, 5], pool.array) == 2
    # Fresh stamps are not rewritten: a read costs no metadata write.
    assert disk.path_of(a[0]).stat().st_mtime_ns == mtime
    monkeypatch.setattr(disk_module, "RESTAMP_AFTER_NS", 0)
    assert disk.get(a, [4, 5], pool.array) == 2
    assert disk.lru_order() == [b[1], b[0], a[1], a[0]]
    disk.close()
    again = backends()
    assert again.wait_ready(5)
    assert again.lru_order() == [b[1], b[0], a[1], a[0]]
