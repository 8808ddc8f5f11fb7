"""A short soak (`asynchicache bench soak`) against a live server: no errors besides the
deliberate disconnects, the same greedy answers, nothing in use once idle, integrity
holds, memory and open files flat, shared memory within the L2 pool."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_helpers import FaultRecord, record, scale
from live_server import REPO, LiveServer

from asynchicache.bench.processes.procwatch import ServerWatch, listening_pid
from asynchicache.bench.soak import SoakConfig, render, run_soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("soak")
    # L1 for a few of the soak's ~900-token prompts at once; L2 small enough to evict.
    srv = LiveServer(root / "kv", root / "server.log", "--device-cache-tokens", "8192").start()
    try:
        yield srv
    finally:
        srv.shutdown()


def test_procwatch_finds_the_server_processes(server: LiveServer) -> None:
    assert listening_pid(server.port) == server.pid
    sample = ServerWatch.for_port(server.port).sample(0.0)
    roles = sample.by_role()
    assert {"http", "engine", "cache-service"} <= set(roles)
    assert roles["engine"].rss > 100 << 20  # the model's weights
    assert sample.shm_segments == 1 and sample.shm_bytes > 0  # the engine's L2 pool


def test_short_soak(server: LiveServer) -> None:
    # CI: 20 s sampled every second (the flatness windows after the 4-s warm-up hold
    # four samples each, where 30 s every 2 s had three); full: 150 s every 2 s.
    full = scale() == "full"
    duration = float(os.environ.get("SOAK_SECONDS", "150" if full else "20"))
    cfg = SoakConfig(server.url, clients=6, duration_s=duration, sample_s=2.0 if full else 1.0,
                     max_tokens=8, disconnect_rate=0.2, prompts=24, prefix_lines=12)  # fmt: skip
    report = asyncio.run(run_soak(cfg))
    print("\n" + render(report))
    rq = report.requests
    record(
        FaultRecord(
            "short soak (deliberate disconnects)",
            rq["deliberate_disconnects"],
            rq["completed"],
            rq["errors"],
            rq["mismatches"],
            seconds=report.seconds,
            notes={"problems": report.problems, "latency_s": report.latency_s},
        )
    )
    assert rq["errors"] == 0, rq["error_examples"]
    assert rq["mismatches"] == 0, rq["mismatch_examples"]
    assert rq["deliberate_disconnects"] > 0 and rq["completed"] > 0
    assert report.end_state["integrity"]["ok"], report.end_state
    assert report.passed, report.problems
    assert all(report.restarts[r] == 0 for r in ("http", "engine", "cache-service"))


def test_soak_cli_runs_and_writes_its_report(server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    argv = [sys.executable, "-m", "asynchicache", "bench", "soak", "--url", server.url,
            "--clients", "2", "--duration", "3", "--sample-interval", "1", "--max-tokens", "4",
            "--prefix-lines", "4",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "soak: 2 clients" in proc.stdout, proc.stdout + proc.stderr
    report = json.loads((out / "soak.json").read_text())
    assert report["requests"]["completed"] > 0 and report["timeline"]
    assert proc.returncode == (0 if report["passed"] else 1)
