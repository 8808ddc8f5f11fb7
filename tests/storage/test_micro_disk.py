"""The disk micro-benchmark runs end to end on a small size (the real run is 800 MB)."""

from __future__ import annotations

from pathlib import Path

from asynchicache.bench.micro.micro_disk import DiskBenchOptions, measure


def test_measure_small(tmp_path: Path) -> None:
    out = measure(DiskBenchOptions(total_mb=8, repeats=1, bench_dir=tmp_path / "bench"))
    for key in ("disk_write_GBps", "disk_read_cold_GBps", "dd_write_GBps", "dd_read_cold_GBps"):
        assert out[key] > 0
    assert out["pages"] == 11 and len(out["runs"]) == 1
    assert out["backend_io"].startswith("O_DIRECT")
    assert "posix_fadvise" in out["cold_read_method"]
    assert not list((tmp_path / "bench").rglob("*.kv"))  # it cleans up after itself


def test_measure_small_encrypted(tmp_path: Path) -> None:
    opts = DiskBenchOptions(total_mb=8, repeats=1, bench_dir=tmp_path / "b", disk_encrypt=True)
    out = measure(opts)
    assert out["disk_write_GBps"] > 0 and out["disk_read_cold_GBps"] > 0
    assert out["backend_io"].startswith("O_DIRECT") and "AES-256-GCM" in out["backend_io"]
