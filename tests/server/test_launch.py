"""The launcher fails fast and cleanly on a busy port or a missing model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from ports import free_port

from asynchicache.launch.launch import make_run_dir, ready_message


def _serve(*argv: str, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp)} if tmp is not None else None
    return subprocess.run(
        [sys.executable, "-m", "asynchicache", "serve", "--device", "cpu", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _run_dirs(tmp: Path) -> set[str]:
    return {p.name for p in tmp.glob("asynchicache-*") if p.is_dir()}


def test_busy_port_fails_at_once() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve("--port", str(port), "--no-disk-cache")
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_missing_model_exits_2_and_cleans_up(tmp_path: Path) -> None:
    # The server's own temp folder: other servers on the machine come and go in /tmp.
    tmp = Path(tempfile.mkdtemp(prefix="acl-"))  # short: ipc socket paths live in it
    before = _run_dirs(tmp)
    proc = _serve(
        "--port",
        str(free_port()),
        "--model",
        str(tmp_path / "nope.gguf"),
        "--disk-cache-dir",
        str(tmp_path / "kv"),
        tmp=tmp,
    )
    assert proc.returncode == 2
    assert "nope.gguf" in proc.stderr
    assert _run_dirs(tmp) - before == set()
    tmp.rmdir()  # nothing else was left in it either


def test_run_dir_is_private() -> None:
    run_dir = make_run_dir()
    try:
        assert run_dir.stat().st_mode & 0o777 == 0o700
        assert run_dir.stat().st_uid == os.getuid()
    finally:
        run_dir.rmdir()


def test_ready_message_has_a_working_curl_line() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        text = ready_message(sock, "m", with_key=True)
    assert f"curl -s http://127.0.0.1:{port}/v1/chat/completions" in text
    assert "Authorization: Bearer $ASYNCHICACHE_API_KEY" in text
