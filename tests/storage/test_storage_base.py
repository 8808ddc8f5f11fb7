"""The storage protocols and shared helpers: what every backend and tier agrees on."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from asynchicache.storage.base import (
    BackendStats,
    StatsCounter,
    StorageBackend,
    StorageTier,
    check_read,
)
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.disk.disk_backend import DiskBackend
from asynchicache.storage.remote.remote_backend import RedisBackend
from asynchicache.storage.service.tiered import TieredBackend


@pytest.mark.parametrize(
    "module", ["asynchicache.hierarchy.hierarchy", "asynchicache.storage.base"]
)
def test_the_cache_layer_loads_neither_redis_nor_zmq(module: str) -> None:
    code = f"import sys, {module}; print(sorted({{'redis', 'zmq'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_service_without_remote_tier_does_not_load_redis() -> None:
    code = "import sys, asynchicache.storage.service.server; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("backend", [DiskBackend, RedisBackend, TieredBackend])
def test_every_backend_is_a_storage_backend(backend: type) -> None:
    assert StorageBackend in backend.__mro__  # declared, so a type checker holds it to it


def test_the_engine_calls_the_tier_verbs_the_client_has() -> None:
    verbs = {"exists", "submit_load", "submit_store", "cancel", "register_pool", "stats", "poll"}
    assert verbs <= set(dir(StorageTier))
    assert all(callable(getattr(StorageClient, verb)) for verb in verbs)


@pytest.mark.parametrize(
    ("hashes", "slots", "pool", "error"),
    [
        ([b"a" * 16], [0, 1], np.zeros((4, 8), np.uint8), "1 hashes but 2 slots"),
        ([b"a" * 16], [4], np.zeros((4, 8), np.uint8), "out of range"),
        ([b"a" * 16], [0], np.zeros((4, 8), np.float32), "uint8"),
        ([b"a" * 16], [0], np.zeros((4, 16), np.uint8), "uint8"),
        ([b"a" * 16], [0], np.zeros((8, 4), np.uint8).T, "C-contiguous"),
    ],
)
def test_check_read_refuses_what_no_backend_could_read_into(
    hashes: list[bytes], slots: list[int], pool: np.ndarray, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        check_read(hashes, slots, pool, page_bytes=8)


def test_stats_counter_adds_named_fields_and_extras_from_many_threads() -> None:
    counter = StatsCounter(BackendStats(capacity_bytes=10))

    def work() -> None:
        for _ in range(1000):
            counter.add(hits=1, late_skipped=2)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = counter.snapshot()
    assert (snap.hits, snap.capacity_bytes, snap.extra) == (4000, 10, {"late_skipped": 8000.0})
    snap.extra["mine"] = 1.0  # a snapshot is the caller's to change
    assert "mine" not in counter.snapshot().extra
