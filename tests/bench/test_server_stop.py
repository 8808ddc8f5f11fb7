"""`BenchServer.stop` leaves nothing running and nothing in /dev/shm, also when the
server hangs and has to be killed.

The server here is a real Python process (tests/bench/shm_server.py) made like
vLLM's: it answers /health, makes multiprocessing shared memory (a `psm_*` segment
its resource tracker, a helper process in its group, removes when its users are
gone) and starts a child in its process group. Killing the whole group at once
kills the tracker too and leaves the segment in /dev/shm; `stop` kills the
tracker last, so it still removes it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from processes import pid_alive

from asynchicache.bench.processes.server_process import BenchServer, _group_members

SCRIPT = Path(__file__).with_name("shm_server.py")


def _server(tmp_path: Path, mode: str) -> tuple[BenchServer, Path]:
    names = tmp_path / "segment"
    command = [sys.executable, str(SCRIPT), "--port", "{port}", "--mode", mode, "--out", str(names)]
    return BenchServer([], tmp_path / f"{mode}.log", 60, command=command), names


def _segment(names: Path) -> Path:
    return Path("/dev/shm") / names.read_text().strip()


@pytest.mark.parametrize("mode", ["exits", "hangs"])
def test_stop_leaves_no_process_and_no_segment(tmp_path: Path, mode: str) -> None:
    server, names = _server(tmp_path, mode)
    server.start()
    assert server.proc is not None
    group = server.proc.pid
    segment = _segment(names)
    assert segment.exists()
    members = _group_members(group)
    assert len(members) >= 3  # the server, its child and its resource tracker

    started = time.monotonic()
    code = server.stop(timeout_s=2.0)
    if mode == "hangs":  # it ignored SIGTERM: killed after 2 s
        assert code == -9
    else:
        assert code == 0
    assert time.monotonic() - started < 30
    assert _group_members(group) == []
    assert not any(pid_alive(pid) for pid in members)
    assert not segment.exists(), f"{segment.name} left in /dev/shm ({server.log_tail()})"
