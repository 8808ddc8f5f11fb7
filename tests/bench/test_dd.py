"""`bench/processes/dd.py`: a real dd reads a real file in the folder, cold."""

from __future__ import annotations

from pathlib import Path

from asynchicache.bench.processes.dd import MIN_BYTES, cold_read


def test_cold_read_reports_dd_bandwidth_and_leaves_nothing(tmp_path: Path) -> None:
    read = cold_read(tmp_path, 1000)
    assert read.num_bytes == MIN_BYTES  # a small prompt is timed on at least 16 MiB
    assert read.buffered_GBps > 0 and read.GBps > 0
    report = read.report()
    assert report["dd_read_cold_GBps"] > 0
    assert report["dd_read_mode"] in ("direct", "buffered")
    assert list(tmp_path.iterdir()) == []  # the file is gone
