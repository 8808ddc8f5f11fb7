"""`python -m asynchicache serve` (or another OpenAI server) as a child process of a
benchmark, on a free port."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from asynchicache.common.liveness import live_processes

log = logging.getLogger(__name__)
Options = TypeVar("Options")  # a bench's options, built from its arguments


_GROUP_GRACE_S = 15.0  # a stopped server's helpers finish their clean-up within this
_TRACKER = "multiprocessing.resource_tracker"


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    return [pid for pid, (_, group) in live_processes().items() if group == pgid]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until process group `pgid` has no live process left."""
    deadline = time.monotonic() + timeout_s
    while _group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (with `with_bus`, port + 10000 free too, for a cluster node's bus).

    Free when probed: a server started on it later may still lose a race for it.
    """
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair found (a cluster node's and its bus's)")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stop_servers_on_sigterm() -> None:
    """SIGTERM as SystemExit: it unwinds through `with server:`, which stops the server."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def start_server_bench(
    name: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    options: Callable[[argparse.Namespace], Options],
) -> tuple[argparse.Namespace, Options]:
    """How a bench that runs servers starts: SIGTERM stops its servers, INFO logs (httpx's
    one line per request kept quiet), its arguments parsed and `options` built from them
    (a ValueError exits naming `asynchicache bench NAME`)."""
    stop_servers_on_sigterm()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parser.parse_args(list(argv))
    try:
        return args, options(args)
    except ValueError as exc:
        raise SystemExit(f"asynchicache bench {name}: {exc}") from exc


class ServerError(RuntimeError):
    """The server did not start, or died; the message carries its log's tail."""


class BenchServer:
    """One server instance; `start` waits until `ready_path` answers, `stop` until it exited.

    `command`: the argv of another server, `{port}` standing for the port (e.g. vLLM's
    `api_server`); by default `python -m asynchicache serve --port PORT FLAGS...`.
    """

    def __init__(
        self,
        flags: Sequence[str],
        log_path: Path,
        startup_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        ready_path: str = "/health",
    ) -> None:
        self.flags = list(flags)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.command = None if command is None else list(command)
        self.ready_path = ready_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http(self) -> httpx.Client:
        """One client for every call until `stop`: a module-level `httpx.get` builds a
        client each time, and loading its CA bundle costs 30-60 ms of CPU, which the
        ready poll (every 0.25 s) paid throughout a start."""
        if self._http is None:
            self._http = httpx.Client()
        return self._http

    def argv(self) -> list[str]:
        if self.command is not None:
            return [a.replace("{port}", str(self.port)) for a in self.command]
        return [
            sys.executable,
            "-m",
            "asynchicache",
            "serve",
            "--port",
            str(self.port),
            *self.flags,
        ]

    def start(self, attempts: int = 3) -> None:
        """Start on a free port; a port taken between probe and bind is retried."""
        for attempt in range(attempts):
            self.port = free_port()
            try:
                self._start_once()
                return
            except ServerError:
                taken = "address already in use" in self.log_tail().lower()
                if attempt == attempts - 1 or not taken:
                    raise
                log.info("port %d was taken; retrying", self.port)

    def _start_once(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            # Its own process group: whatever it spawns can be stopped with it.
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:  # not ready, or we are interrupted: leave nothing running
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"the server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if self.http.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise ServerError(
            f"no {self.ready_path} answer in {self.startup_timeout_s}s:\n{self.log_tail()}"
        )

    def get_json(self, path: str) -> dict:
        resp = self.http.get(self.url + path, timeout=60)
        resp.raise_for_status()
        return resp.json()

    def stop(self, timeout_s: float = 60.0, sig: int = signal.SIGTERM) -> int | None:
        """`sig` (SIGTERM; SIGINT is a Ctrl-C: the launcher stops its children in order),
        SIGKILL to its process group if it hangs; then its helpers get a grace period to
        finish (multiprocessing's resource tracker unlinks the shared memory and
        semaphores the server left, in /dev/shm) before what is left is killed."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "server %d ignored signal %d for %.0fs; killing it", self.proc.pid, sig, timeout_s
            )
            self._kill_group()
            return self.proc.wait(30)
        if not _group_gone(self.proc.pid, _GROUP_GRACE_S):
            log.warning("server %d left processes behind; killing them", self.proc.pid)
        self._kill_group()
        return code

    def _kill_group(self) -> None:
        """SIGKILL the group, its resource trackers last: once the processes that used
        them are gone they remove what those left in /dev/shm, then exit."""
        assert self.proc is not None
        pgid = self.proc.pid
        for pid in _group_members(pgid):
            if _TRACKER not in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        _group_gone(pgid, _GROUP_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left
            os.killpg(pgid, signal.SIGKILL)

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
