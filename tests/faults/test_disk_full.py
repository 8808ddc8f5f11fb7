"""A full disk under load: stores fail cleanly (counted), serving goes on with correct answers.

The disk folder lives on a small tmpfs the test mounts (24 MB: about 32 pages of
the default model) when it may (root); otherwise it is capped with
--disk-cache-gb, and the limit must hold instead.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_helpers import FaultRecord, knob, page_files, record, temp_files, verify_disk
from live_server import LiveServer, metric
from traffic import Load, make_prompts, references

from asynchicache.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TMPFS_MB = 24
CAP_GB = 0.024


@dataclass(frozen=True)
class SmallDisk:
    folder: Path
    kind: str  # "tmpfs" (writes hit ENOSPC) or "capacity" (--disk-cache-gb evicts)

    @property
    def extra(self) -> tuple[str, ...]:
        return () if self.kind == "tmpfs" else ("--disk-cache-gb", str(CAP_GB))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    argv = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m,mode=0700", "tmpfs", str(mnt)]
    mounted = os.geteuid() == 0 and subprocess.run(argv, capture_output=True).returncode == 0
    try:
        yield SmallDisk(mnt / "kv", "tmpfs" if mounted else "capacity")
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)


def _drained(server: LiveServer, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["cache"]["pending_storage"] == 0:
            return stats
        time.sleep(0.25)
    raise AssertionError("stores still pending")


def test_full_disk_fails_stores_cleanly_and_serving_goes_on(
    small_disk: SmallDisk, tmp_path: Path, tok: Tokenizer
) -> None:
    server = LiveServer(small_disk.folder, tmp_path / "server.log", *small_disk.extra).start()
    try:
        t0 = time.monotonic()
        prompts = make_prompts(tok, "f", knob("disk_full_prompts"))
        expected = references(server.url, prompts, knob("clients"))  # these fill the disk
        with Load(server.url, prompts, expected, knob("clients")) as load:
            # Until every prompt was asked once more on the full disk (at most phase_s).
            load.served_more(len(prompts), knob("phase_s"))
        result = load.result
        stats = _drained(server)
        samples = server.metrics()
        store_failures = metric(samples, "asynchicache_storage_store_failures_total", tier="disk")
        disk = stats["storage"]["disk"]
        integrity = server.stats(integrity=True)["integrity"]
        used = sum(p.stat().st_size for p in page_files(small_disk.folder))
        record(
            FaultRecord(
                f"disk full ({small_disk.kind})",
                int(store_failures if small_disk.kind == "tmpfs" else disk["evictions"]),
                result.served,
                result.failed,
                result.wrong,
                seconds=time.monotonic() - t0,
                notes={
                    "pages_on_disk": len(page_files(small_disk.folder)),
                    "bytes_on_disk": used,
                    "store_failures": store_failures,
                    "evictions": disk["evictions"],
                    "cached_tokens_by_tier": result.tiers,
                },
            )
        )
        assert result.failed == 0 and result.wrong == 0, result.failures[:10]
        # The reference pass already asked every prompt once while the disk filled;
        # how many more the timed phase serves depends on the machine's load.
        assert result.served > 0
        if small_disk.kind == "tmpfs":
            assert store_failures > 0, "the disk never filled up"
        else:
            assert disk["evictions"] > 0 and used <= CAP_GB * 1e9
        assert temp_files(small_disk.folder) == [], "a failed write left its temp file"
        assert verify_disk(small_disk.folder) == 0
        assert integrity["ok"], integrity
    finally:
        assert server.shutdown() == 0
