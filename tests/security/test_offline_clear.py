"""Issue 22, finding 9: `asynchicache cache clear` on a folder a live server uses.

A running cache service leases its namespace folder (a shared flock, held until it
exits); the offline clear refuses such a folder, removing nothing, unless `--force`.
The live side here is the disk tier itself (`DiskBackend`, what the cache service runs),
the clear a real `asynchicache cache clear` process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pools import NAMESPACE, SMALL, Pool, new_hashes, refs

from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig


def _clear(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", "clear", "--disk-cache-dir", str(root),
         "--json", *extra],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _pages(root: Path) -> int:
    return len(list(root.rglob("*.kv")))


def test_clear_refuses_a_folder_a_live_server_uses(
    tmp_path: Path, make_pool: Callable[..., Pool]
) -> None:
    root = tmp_path / "kv"
    pool = make_pool(8)
    live = DiskBackend(DiskConfig(root, NAMESPACE, SMALL, 1 << 30))
    try:
        live.put(refs(new_hashes(4), range(4)), pool.array)
        refused = _clear(root)
        assert refused.returncode != 0
        assert "running server" in refused.stderr and "--force" in refused.stderr
        assert _pages(root) == 4  # nothing removed
        forced = _clear(root, "--force")
        assert forced.returncode == 0, forced.stderr
        assert json.loads(forced.stdout)["disk"]["removed"] == 4 and _pages(root) == 0
    finally:
        live.close()


def test_clear_of_a_folder_nobody_uses_needs_no_force(
    tmp_path: Path, make_pool: Callable[..., Pool]
) -> None:
    root = tmp_path / "kv"
    pool = make_pool(8)
    stopped = DiskBackend(DiskConfig(root, NAMESPACE, SMALL, 1 << 30))
    stopped.put(refs(new_hashes(3), range(3)), pool.array)
    stopped.close()  # the server stopped: its lease went with it
    done = _clear(root)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["disk"]["removed"] == 3 and _pages(root) == 0


def test_only_the_namespaces_asked_for_count(
    tmp_path: Path, make_pool: Callable[..., Pool]
) -> None:
    """A live server on another namespace of the folder does not block clearing this one."""
    root = tmp_path / "kv"
    pool = make_pool(8)
    old = DiskBackend(DiskConfig(root, b"old-model\x1ffloat32", SMALL, 1 << 30))
    old.put(refs(new_hashes(2), range(2)), pool.array)
    old_folder = old.config.folder.name
    old.close()
    live = DiskBackend(DiskConfig(root, NAMESPACE, SMALL, 1 << 30))
    try:
        live.put(refs(new_hashes(2), range(2)), pool.array)
        assert _clear(root).returncode != 0 and _pages(root) == 4
        done = _clear(root, "--namespace", old_folder)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["disk"]["removed"] == 2 and _pages(root) == 2
    finally:
        live.close()


def test_force_goes_with_clear_only(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", "stats", "--disk-cache-dir",
         str(tmp_path), "--force"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "--force" in proc.stderr
