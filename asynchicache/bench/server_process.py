"""`python -m asynchicache serve` as a child process of a benchmark, on a free port."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server did not start, or died; the message carries its log's tail."""


class BenchServer:
    """One server instance; `start` waits until /health answers, `stop` until it exited."""

    def __init__(
        self, flags: Sequence[str], log_path: Path, startup_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.flags = list(flags)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "asynchicache", "serve", "--port", str(self.port),
                *self.flags]

    def start(self, attempts: int = 3) -> None:
        """Start on a free port; a port taken between probe and bind is retried."""
        for attempt in range(attempts):
            self.port = free_port()
            try:
                self._start_once()
                return
            except ServerError:
                if attempt == attempts - 1 or "address already in use" not in self.log_tail():
                    raise
                log.info("port %d was taken; retrying", self.port)

    def _start_once(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with {self.proc.returncode}:\n"
                                  f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"no /health answer in {self.startup_timeout_s}s:\n{self.log_tail()}")

    def get_json(self, path: str) -> dict:
        resp = httpx.get(self.url + path, timeout=60)
        resp.raise_for_status()
        return resp.json()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the launcher stops its children in order), SIGKILL if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("server %d ignored SIGTERM for %.0fs; killing it", self.proc.pid, timeout_s)
            self.proc.kill()
            return self.proc.wait(30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> BenchServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
