"""`/ready` with real processes behind the app: a fake engine process (the real wire
protocol) and a real cache service process (`asynchicache service`).
200 only while both answer; 503 naming the one that does not when the service is killed
or the engine is gone; 200 again once a new service binds the same address. `/health`
stays liveness. (A SIGSTOPped service inside a real `serve` is in test_cache_ops.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_helpers import ThreadServer
from service_process import ServiceProcess

from asynchicache.launch.frontend import Frontend

HERE = Path(__file__).resolve().parent


@dataclass
class Stack:
    server: ThreadServer
    engine: subprocess.Popen[bytes]
    service: ServiceProcess
    disk: Path
    address: str


def _ready(url: str) -> httpx.Response:
    return httpx.get(url + "/ready", timeout=30)


def _wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _ready(url).status_code != 200:
        assert time.monotonic() < deadline, _ready(url).text
        time.sleep(0.2)


@pytest.fixture
def stack(tmp_path: Path, frontend: Frontend) -> Iterator[Stack]:
    sock_dir = Path(tempfile.mkdtemp(prefix="acq-"))  # ipc:// paths are limited to ~107 bytes
    address = f"ipc://{sock_dir}/svc.sock"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent)}
    engine = subprocess.Popen([sys.executable, str(HERE / "fake_engine.py"), str(run_dir)], env=env)
    services = [ServiceProcess(tmp_path / "kv", address).start()]
    server = ThreadServer(run_dir, frontend, None, service_addr=address)
    try:
        server.start()
        stack = Stack(server, engine, services[0], tmp_path / "kv", address)
        yield stack
        services.append(stack.service)
    finally:
        server.close()
        for service in services:
            service.stop()
        if engine.poll() is None:
            engine.terminate()
            engine.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_ready_when_both_answer_and_503_while_the_service_is_dead(stack: Stack) -> None:
    url = stack.server.url
    _wait_ready(url)
    assert _ready(url).json()["checks"] == {"engine": "ok", "cache_service": "ok"}
    stack.service.kill()
    r = _ready(url)
    assert r.status_code == 503, r.text
    assert r.json()["checks"]["engine"] == "ok"
    assert r.json()["reason"].startswith("cache_service: no answer"), r.text
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # liveness: still alive
    stack.service = ServiceProcess(stack.disk, stack.address).start()  # as the supervisor does
    _wait_ready(url)


def test_503_when_the_engine_is_gone(stack: Stack) -> None:
    url = stack.server.url
    _wait_ready(url)
    stack.engine.send_signal(signal.SIGKILL)
    stack.engine.wait(10)
    r = _ready(url)
    assert r.status_code == 503, r.text
    assert r.json()["checks"]["cache_service"] == "ok"
    assert r.json()["reason"].startswith("engine: unavailable"), r.text


def test_503_while_the_service_is_stopped(stack: Stack) -> None:
    """An answer to a ping sent before the service stopped is no answer to this question
    (it sat in the socket's queue: /ready said 200 for a SIGSTOPped service)."""
    url = stack.server.url
    _wait_ready(url)
    assert _ready(url).status_code == 200
    time.sleep(0.5)  # the answer to that call's last ping arrives, and waits to be read
    stack.service.signal(signal.SIGSTOP)
    try:
        r = _ready(url)
        assert r.status_code == 503, r.text
        assert r.json()["reason"].startswith("cache_service: no answer"), r.text
    finally:
        stack.service.signal(signal.SIGCONT)
    _wait_ready(url)
