"""Issue 39, finding 13: the cache service is never fatal.

A dozen faults of the cache service under load, close together (each within the
supervisor's `stable_s` of the last restart, so that they read as a crash loop), in
turn: SIGSTOP for 3 s of a service that answers (`/ready` is 200: past the 3x
`--storage-timeout` silence limit the launcher kills and replaces it), and SIGKILL
of whatever service runs, at once. On 9f7c8b6 the sixth such fault ended the
server (`cache-service died (exit code -9); shutting down`) and every request after
it. Now: zero failed requests, zero wrong answers (greedy answers equal to their
cold references), the server still up, a service back and `/ready` green at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
from fault_helpers import FaultRecord, record
from host_speed import scaled
from live_server import LiveServer
from settling import wait_until
from traffic import Load, make_prompts, references

from asynchicache.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAULTS = 12
STOP_S = 3.0  # > 3 x 0.5 s + a watch turn: the frozen service is declared dead, replaced
GAP_S = (0.3, 1.0)
SETTLE_S = 1.5  # a few of the launcher's watch turns
CLIENTS = 3
SERVICE_BACK_S = 120.0  # a replaced service answers again (spawn, imports, index scan)


def _up(server: LiveServer) -> bool:
    return server.proc is not None and server.proc.poll() is None


def _ready(server: LiveServer) -> bool:
    try:
        return httpx.get(server.url + "/ready", timeout=scaled(10)).status_code == 200
    except httpx.HTTPError:
        return False


def _service_pid(server: LiveServer, answering: bool) -> int:
    """The live cache service's pid (waits while it is being replaced; with `answering`,
    until it answers pings too). Fails at once when the server exited."""

    def found() -> int | None:
        assert _up(server), f"the server exited:\n{server.log_tail()}"
        if answering and not _ready(server):
            return None
        return server.pids().get("cache-service")

    return wait_until(found, "a cache service", SERVICE_BACK_S, every_s=0.25)


def _fault(server: LiveServer, kind: str) -> None:
    pid = _service_pid(server, answering=kind == "stop")
    if kind == "stop":
        # The launcher's own probe reads the first answer on its next watch turn (0.5 s);
        # until then the service counts as starting (120 s of silence allowed).
        time.sleep(SETTLE_S)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
    if kind == "stop":
        time.sleep(STOP_S)
        with contextlib.suppress(ProcessLookupError):  # killed while frozen: the point
            os.kill(pid, signal.SIGCONT)


def test_a_dozen_service_faults_under_load_fail_nothing(tmp_path: Path, tok: Tokenizer) -> None:
    rng = random.Random(39)
    server = LiveServer(tmp_path / "kv", tmp_path / "server.log", "--storage-timeout", "0.5")
    t0 = time.monotonic()
    try:
        server.start()
        prompts = make_prompts(tok, "never-fatal", 6)
        expected = references(server.url, prompts, CLIENTS)
        with Load(server.url, prompts, expected, CLIENTS) as load:
            assert load.served_more(1, 120), load.result.failures[:5]
            for i in range(FAULTS):
                time.sleep(rng.uniform(*GAP_S))
                _fault(server, "stop" if i % 2 == 0 else "kill")
            _service_pid(server, answering=True)
            served = load.served_more(2 * CLIENTS, 120)
        result = load.result
        up = _up(server)
    finally:
        log = server.log_path.read_text(errors="replace")
        server.shutdown()
    restarts, silenced = log.count("cache-service died"), log.count("alive but silent")
    record(FaultRecord("cache service stopped/killed 12 times in a row under load",
                       FAULTS, result.served, result.failed, result.wrong,
                       seconds=time.monotonic() - t0,
                       notes={"restarts": restarts, "killed_silent": silenced}))  # fmt: skip
    assert result.failed == 0 and result.wrong == 0, result.failures[:10]
    assert up, log[-4000:]
    assert served, f"no request served after the faults:\n{log[-4000:]}"
    assert restarts >= FAULTS - 1 and silenced >= FAULTS // 2 - 1, (restarts, silenced)
