"""A real cache service process (`asynchicache service`) for a test."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


class ServiceProcess:
    """The service on `address` over `disk_dir`; `extra` adds flags (e.g. `--remote-url`)."""

    def __init__(self, disk_dir: Path, address: str, *extra: str) -> None:
        self.argv = [sys.executable, "-m", "asynchicache", "service"]
        self.argv += ["--disk-cache-dir", str(disk_dir), "--socket", address]
        self.argv += ["--log-level", "WARNING", *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        self.proc = subprocess.Popen(self.argv)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (a clean shutdown; woken first if frozen), kill -9 if it does not exit."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode
