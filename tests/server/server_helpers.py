"""A live HTTP server for tests: the real app under uvicorn, in a thread, on a free port."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from asynchicache.config import ServerConfig
from asynchicache.server.context import AppContext, ModelInfo
from asynchicache.server.engine_client import EngineClient
from asynchicache.server.frontend import Frontend
from asynchicache.server.http import StopSignal, bind_socket, serve_http

API_KEY = "test-key"
FAKE_CONTEXT = 256


class ThreadServer:
    """The real app under uvicorn on a free port, in a thread, talking to an engine over IPC."""

    def __init__(
        self,
        run_dir: Path,
        frontend: Frontend,
        api_key: str | None,
        admin_api_key: str | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.frontend = frontend
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: StopSignal | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = StopSignal(asyncio.Event())
        client = EngineClient.for_run_dir(self.run_dir)
        await client.start()
        model = ModelInfo("fake-model", FAKE_CONTEXT, self.frontend.config.vocab_size)
        ctx = AppContext(
            client,
            self.frontend.tokenizer,
            model,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
        )
        try:
            await serve_http(ctx, ServerConfig(log_level="warning"), self.sock, self._stop)
        finally:
            await client.close()

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the test server did not become healthy")

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set, "test done")
        self._thread.join(15)
        self.sock.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m asynchicache serve` as a subprocess, the way a user runs it."""

    def __init__(self, disk_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [
            sys.executable, "-m", "asynchicache", "serve", "--port", str(self.port),
            "--device", "cpu", "--disk-cache-dir", str(disk_dir),
            "--device-cache-tokens", "4096", "--log-level", "info", *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.child_pids: list[int] = []

    def start(self, timeout_s: float = 300.0) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.child_pids = children_of(self.proc.pid)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy in {timeout_s}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def shutdown(self) -> None:
        """SIGTERM, then wait for the children too (SIGKILL only if that hangs)."""
        if self.proc is None:
            return
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in self.child_pids) and time.monotonic() < deadline:
            time.sleep(0.1)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
