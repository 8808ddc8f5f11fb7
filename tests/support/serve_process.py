"""`python -m asynchicache serve` on CPU as a test's subprocess: the benchmarks' launcher
(`bench/processes/server_process.py`: a free port, retried if taken; /health awaited; SIGTERM,
then SIGKILL if it hangs), with `start` returning the server, its children by pid, and a
`terminate` that leaves them to the server (so a test sees what it leaves behind)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from host_speed import scaled
from processes import children_of, pid_alive

from asynchicache.bench.processes.server_process import BenchServer


class ServeProcess(BenchServer):
    """A server with `flags` after `--device cpu`, logging to `log_path`; its start-up
    timeout is the reference host's, scaled to this one (host_speed.py)."""

    def __init__(
        self,
        log_path: Path,
        *flags: str,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        timeout_s = scaled(startup_timeout_s)
        super().__init__(["--device", "cpu", *flags], log_path, timeout_s, env)
        self.child_pids: list[int] = []  # its children once it answered /health

    def start(self, attempts: int = 3) -> ServeProcess:  # type: ignore[override]
        super().start(attempts)
        self.child_pids = self.children()
        return self

    def children(self) -> list[int]:
        """The live children of the server now."""
        assert self.proc is not None
        return children_of(self.proc.pid)

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the server alone and wait for its exit code (its children are its job)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def shutdown(self) -> int | None:
        """`stop` (SIGTERM, SIGKILL to the group if it hangs), then wait for its children."""
        code = self.stop()
        deadline = time.monotonic() + 30
        while any(pid_alive(pid) for pid in self.child_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return code


def disk_server(disk_dir: Path, log_path: Path, *extra: str) -> ServeProcess:
    """A server with a disk tier in `disk_dir` and 4,096 L1 tokens (`extra` may override)."""
    flags = ["--disk-cache-dir", str(disk_dir), "--device-cache-tokens", "4096"]
    return ServeProcess(log_path, *flags, "--log-level", "info", *extra)


def start_together(
    servers: Sequence[ServeProcess], then: Callable[[ServeProcess], object] | None = None
) -> None:
    """Start `servers` at once, then call `then` on each (in its own thread too).

    A start is mostly one process at a time importing and loading (one core), so two
    servers start in about the time of one. If any start fails, every server is stopped
    and the first error is raised.
    """

    def one(server: ServeProcess) -> None:
        server.start()
        if then is not None:
            then(server)

    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(one, s) for s in servers]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]


def shutdown_together(servers: Sequence[ServeProcess]) -> list[int | None]:
    """`shutdown` of every server at once (each waits on its own processes); the exit codes."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        return list(pool.map(lambda s: s.shutdown(), servers))
