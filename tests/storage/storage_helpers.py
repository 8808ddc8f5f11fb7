"""Helpers for the storage tests: small page layouts and real shared-memory pools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.shm import SharedSegment

# 1 KiB pages take the buffered path; 8 KiB pages are 4096-aligned and use O_DIRECT.
SMALL = PageLayout("float32", (2, 2, 4, 2, 8))
ALIGNED = PageLayout("float32", (2, 2, 16, 2, 16))
# The default model's page: 30 layers x 2 x 16 tokens x 3 kv heads x 64 x 4 bytes = 737,280.
DEFAULT = PageLayout("float32", (30, 2, 16, 3, 64))
NAMESPACE = b"test-model\x1ffloat32\x1f4\x1f1\x1f"


class Pool:
    """An L2-like pool: a real shared-memory segment viewed as `[slots, page_bytes]`."""

    def __init__(self, slots: int, layout: PageLayout) -> None:
        self.layout = layout
        self.segment = SharedSegment.create(slots * layout.page_bytes, tag="test")
        self.array = self.segment.as_array().reshape(slots, layout.page_bytes)

    def fill(self, slots: range | list[int], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        for s in slots:
            self.array[s] = rng.integers(0, 256, self.layout.page_bytes, dtype=np.uint8)

    def close(self) -> None:
        del self.array
        self.segment.close()


def new_hashes(n: int) -> list[bytes]:
    """`n` distinct 16-byte page names (the disk tier treats hashes as opaque names)."""
    return [os.urandom(16) for _ in range(n)]


def refs(hashes: list[bytes], slots: list[int] | range) -> list[PageRef]:
    return [
        PageRef(h, tuple(range(i, i + 4)), s)
        for i, (h, s) in enumerate(zip(hashes, slots, strict=True))
    ]


class ServiceProcess:
    """A real cache service process (`python -m asynchicache.storage.service`)."""

    def __init__(self, disk_dir: Path, address: str, *extra: str) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "asynchicache.storage.service",
            "--disk-cache-dir",
            str(disk_dir),
            "--socket",
            address,
            "--log-level",
            "WARNING",
            *extra,
        ]
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

    def stop(self) -> int:
        """SIGTERM (a clean shutdown), then kill -9 if it does not exit in time."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


class ServeProcess:
    """`python -m asynchicache serve` on a free port, logging to a file; stopped with SIGTERM."""

    def __init__(self, log_path: Path, *flags: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "asynchicache", "serve", "--port", str(self.port)]
        self.argv += ["--device", "cpu", *flags]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> ServeProcess:
        import time

        import httpx

        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy in {timeout_s}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]
