"""`python -m asynchicache serve` on CPU as a test's subprocess: the benchmarks' launcher
(`bench/server_process.py`: a free port, retried if taken; /health awaited; SIGTERM,
then SIGKILL if it hangs), with `start` returning the server."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from asynchicache.bench.server_process import BenchServer


class ServeProcess(BenchServer):
    """A server with `flags` after `--device cpu`, logging to `log_path`."""

    def __init__(
        self,
        log_path: Path,
        *flags: str,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(["--device", "cpu", *flags], log_path, startup_timeout_s, env)

    def start(self, attempts: int = 3) -> ServeProcess:  # type: ignore[override]
        super().start(attempts)
        return self
