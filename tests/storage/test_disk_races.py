"""DiskBackend under concurrent puts: what the index says is what the folder holds."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from pools import DEFAULT, NAMESPACE, Pool, refs

from asynchicache.storage.disk.disk_backend import TMP_PREFIX, DiskBackend, DiskConfig


def _hashes(first: int, n: int) -> list[bytes]:
    """`n` page names whose files all live in sub-folder `first:02x` (easy to watch)."""
    return [bytes([first]) + os.urandom(15) for _ in range(n)]


def _writing(folder: Path) -> bool:
    try:
        return any(e.name.startswith(TMP_PREFIX) for e in os.scandir(folder))
    except FileNotFoundError:
        return False


def _index_matches_folder(disk: DiskBackend) -> list[bytes]:
    """Indexed pages whose file is missing."""
    return [h for h in disk.lru_order() if not disk.path_of(h).exists()]


def test_a_put_does_not_re_index_a_page_another_put_evicted(
    tmp_path: Path, make_pool: Callable[..., Pool]
) -> None:
    """Defect 4 of issue 11: put A skips H (indexed), put B's reserve evicts and unlinks H,
    A's commit must not put H back in the index nor count it as stored."""
    pool = make_pool(66, DEFAULT, fill=66, seed=4)
    k = 64  # A's new pages: a write long enough for B to run inside it
    conclusive = 0
    for round_ in range(3):
        h = _hashes(0x11, 1)
        xs = _hashes(0xAA, k)
        y = _hashes(0x22, 1)
        root = tmp_path / f"kv{round_}"
        probe = DiskBackend(DiskConfig(root, NAMESPACE, DEFAULT, 1 << 30))
        assert probe.put(refs(h, [0]), pool.array) == 1
        file_size = probe.path_of(h[0]).stat().st_size
        probe.close()
        # Room for H and A's pages exactly: B's one page must evict H (the oldest).
        disk = DiskBackend(DiskConfig(root, NAMESPACE, DEFAULT, (1 + k) * file_size))
        try:
            assert disk.wait_ready(10) and disk.exists(h) == 1
            results: dict[str, int] = {}

            def put_a() -> None:
                results["a"] = disk.put(refs(h + xs, range(1 + k)), pool.array)  # noqa: B023

            a = threading.Thread(target=put_a)
            a.start()
            watched = disk.path_of(xs[0]).parent
            while a.is_alive() and not _writing(watched):
                pass
            results["b"] = disk.put(refs(y, [65]), pool.array)
            a.join(60)
            assert results["b"] == 1
            if disk.path_of(h[0]).exists():
                continue  # A had committed before B reserved: H was fresh, B evicted another
            conclusive += 1
            assert disk.exists(h) == 0, f"round {round_}: an evicted page is indexed again"
            assert results["a"] == k, f"round {round_}: A counted the evicted page as stored"
            assert _index_matches_folder(disk) == []
        finally:
            disk.close()
    assert conclusive > 0, "B never ran inside A's write: the race was not exercised"
