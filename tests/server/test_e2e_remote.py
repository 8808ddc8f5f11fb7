"""End to end with the remote tier: two server instances with their own disk folders
share one real redis-server; the second serves the first one's long prompt from L4."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import ServerProcess, free_port
from test_e2e import _tiers, _timed_chat, long_messages

pytestmark = pytest.mark.slow


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:  # scripts/ensure-services.sh installs it (make test runs it first)
        subprocess.run(["bash", "scripts/ensure-services.sh"], check=False)
        binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is needed: run scripts/ensure-services.sh as root"
    folder = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not _ping(port):
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_second_instance_serves_the_prompt_from_remote(tmp_path: Path, redis_url: str) -> None:
    first = ServerProcess(tmp_path / "kv-a", tmp_path / "a.log", "--remote-url", redis_url)
    first.start()
    try:
        cold_ttft, cold_text, _ = _timed_chat(first, long_messages(20))
        time.sleep(1.0)  # the service writes L4 behind L3
    finally:
        first.shutdown()
    second = ServerProcess(tmp_path / "kv-b", tmp_path / "b.log", "--remote-url", redis_url)
    second.start()
    try:
        ttft, text, usage = _timed_chat(second, long_messages(20))
    finally:
        second.shutdown()
    tiers = _tiers(usage)
    print(f"\nremote: TTFT {ttft:.3f}s (cold {cold_ttft:.3f}s), tiers {tiers}")
    assert text == cold_text
    assert tiers["remote"] >= 352  # all full pages of a ~410-token prompt
    assert ttft <= 0.5 * cold_ttft
