"""`asynchicache cache stats|verify|clear` on a real folder, as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pools import NAMESPACE, SMALL, Pool, new_hashes, refs

from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_stats_verify_clear(tmp_path: Path, make_pool: Callable[..., Pool]) -> None:
    root = tmp_path / "kv"
    pool = make_pool(8)
    for ns in (NAMESPACE, b"other\x1fbfloat16"):
        disk = DiskBackend(DiskConfig(root, ns, SMALL, 1 << 30))
        disk.put(refs(new_hashes(4), range(4)), pool.array)
        disk.close()
    files = sorted(root.rglob("*.kv"))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(b"garbage")

    stats = _cli("stats", "--disk-cache-dir", str(root), "--json")
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    assert report["pages"] == 8 and len(report["namespaces"]) == 2
    assert "test-model | float32" in _cli("stats", "--disk-cache-dir", str(root)).stdout

    verify = _cli("verify", "--disk-cache-dir", str(root))
    assert verify.returncode == 1 and "2 bad page files removed" in verify.stdout
    assert "payload checksum mismatch" in verify.stdout and "bad header" in verify.stdout
    assert not files[0].exists() and not files[1].exists()
    again = _cli("verify", "--disk-cache-dir", str(root), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["pages"] == 6

    keep = root / "notes.txt"
    keep.write_text("someone else's file")
    clear = _cli("clear", "--disk-cache-dir", str(root), "--json")
    out = json.loads(clear.stdout)
    assert clear.returncode == 0 and out["removed"] == 6 and out["disk"]["removed"] == 6
    assert not list(root.rglob("*.kv")) and keep.exists()
    assert not [p for p in root.iterdir() if p.name.startswith("ns-")]  # empty folders gone


def test_missing_folder_is_empty_not_an_error(tmp_path: Path) -> None:
    out = _cli("stats", "--disk-cache-dir", str(tmp_path / "none"), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["pages"] == 0


def test_clear_one_namespace_or_one_salt_keeping_pins(
    tmp_path: Path, make_pool: Callable[..., Pool]
) -> None:
    from asynchicache.common.keys import Namespace, chain_hashes
    from asynchicache.storage.base import PageRef
    from asynchicache.storage.disk.names import namespace_dir_name

    root = tmp_path / "kv"
    pool = make_pool(16, fill=16)
    ns = Namespace("m", "float32", SMALL.shape[2])

    def chain(digest: bytes, first: int) -> list[PageRef]:
        tokens = list(range(first, first + 3 * SMALL.shape[2]))
        hashes = chain_hashes(digest, tokens, SMALL.shape[2])
        return [PageRef(h, (i,), i, ([digest, *hashes])[i]) for i, h in enumerate(hashes)]

    disk = DiskBackend(DiskConfig(root, ns.encode(), SMALL, 1 << 30))
    tenant, pinned, plain = (
        chain(ns.with_salt("t").digest(), 0),
        chain(ns.with_salt("t").digest(), 99),
        chain(ns.digest(), 0),
    )
    for run in (tenant, pinned, plain):
        disk.put(run, pool.array)
    disk.pin([p.page_hash for p in pinned], ns.with_salt("t").digest(), "t")
    disk.close()
    other = DiskBackend(DiskConfig(root, NAMESPACE, SMALL, 1 << 30))
    other.put(refs(new_hashes(2), range(2)), pool.array)
    other.close()
    folder = namespace_dir_name(ns.encode())

    salt = _cli("clear", "--disk-cache-dir", str(root), "--cache-salt", "t", "--json")
    out = json.loads(salt.stdout)
    assert salt.returncode == 0 and out["disk"]["removed"] == 3, salt.stderr
    assert out["disk"]["pinned_kept"] == 3 and out["disk"]["namespaces"][folder] == 3
    ours = _cli("clear", "--disk-cache-dir", str(root), "--namespace", folder, "--json")
    assert json.loads(ours.stdout)["disk"] == {
        "removed": 3,
        "pinned_kept": 3,
        "errors": [],
        "namespaces": {folder: 3},
    }
    forced = _cli("clear", "--disk-cache-dir", str(root), "--namespace", folder, "--include-pinned")
    assert forced.returncode == 0 and "disk: removed 3 pages, kept 0 pinned" in forced.stdout
    assert not (root / folder).exists()  # nothing left in it: the folder went too
    assert len(list(root.rglob("*.kv"))) == 2  # the other namespace's pages
    bad = _cli("clear", "--disk-cache-dir", str(root), "--namespace", "ns-nope")
    assert bad.returncode != 0 and "no such folder" in bad.stderr
    misuse = _cli("stats", "--disk-cache-dir", str(root), "--remote-url", "redis://x")
    assert misuse.returncode != 0 and "only go with clear" in misuse.stderr
