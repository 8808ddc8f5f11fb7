"""Issue 22, finding 10: `serve --host 0.0.0.0` without `--api-key` warns at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ports import free_port

from asynchicache.launch.options import exposure_warnings
from asynchicache.settings.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("host", "key", "warned"),
    [("0.0.0.0", None, True), ("::", None, True), ("10.0.0.5", None, True),
     ("my-host", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
     ("::1", None, False), ("localhost", None, False)],
)  # fmt: skip
def test_who_is_warned(host: str, key: str | None, warned: bool) -> None:
    lines = exposure_warnings(ServerConfig(host=host, api_key=key))
    assert bool(lines) == warned
    if warned:
        assert "--api-key" in lines[0] and host in lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_on_every_interface_without_a_key_warns_at_start() -> None:
    cmd = [sys.executable, "-m", "asynchicache", "serve", "--device", "cpu", "--no-disk-cache",
           "--host", "0.0.0.0", "--port", str(free_port())]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ASYNCHICACHE_API_KEY", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    seen: list[str] = []
    warned = threading.Event()
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "WARNING" in line and "without --api-key" in line:
                warned.set()
            if "asynchicache ready" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not (warned.is_set() or ready.is_set() or proc.poll() is not None):
            assert time.monotonic() < deadline, "serve neither warned nor started"
            time.sleep(0.05)
        assert warned.is_set(), "no warning at start:\n" + "".join(seen[-20:])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
