"""Child processes of the server: start, watch, restart, and stop them without leftovers.

Each child is a `multiprocessing` spawn-context process that runs `_child_main`:
it names itself (`asynchicache: <role>`), leaves the terminal's process group
(so Ctrl-C reaches only the launcher, which stops children in order), and asks
the kernel to SIGTERM it if the launcher dies (no orphans, even after kill -9).

A child with a `probe` (the cache service) is also watched for silence: alive
but not answering its health ping for `silent_limit_s` (stopped by a signal,
hung), it is killed and restarted like a crashed one. For the cache service
that matters beyond availability: engines keep the L2 slots of tickets they
gave up quarantined until the service answers or exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its parent exits (Linux prctl; best effort elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _child_main(role: str, parent_pid: int, target: Callable[[Any], None], arg: Any) -> None:
    """Entry point of every child (module level, so the spawn context can import it)."""
    from setproctitle import setproctitle

    os.setpgrp()
    _die_with_parent(parent_pid)
    setproctitle(f"asynchicache: {role}")
    target(arg)


@contextlib.contextmanager
def _environment(pairs: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """`pairs` set in os.environ for the block, then put back as they were."""
    saved = {key: os.environ.get(key) for key, _ in pairs}
    os.environ.update(pairs)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


MAX_BACKOFF_S = 5.0


def backoff_s(restarts: int, first_s: float) -> float:
    """How long to wait before the next restart after `restarts` crashes in a row:
    `first_s`, doubling, at most MAX_BACKOFF_S."""
    return min(first_s * 2 ** min(restarts, 10), MAX_BACKOFF_S)


class Probe(Protocol):
    """A health ping that never blocks (e.g. `storage.client.probe.ServiceProbe`)."""

    @property
    def answered(self) -> bool:
        """Whether the child answered at least once."""
        ...

    def silent_s(self) -> float:
        """Seconds since the child last answered; sends the next ping."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ChildSpec:
    """How to (re)start one child: `target(arg)` runs in the new process."""

    role: str
    target: Callable[[Any], None]
    arg: Any
    restart: bool = False  # restart it when it dies (the cache service)
    # Crashes in a row, each within `stable_s` of its start, before the server gives up;
    # None: never (the cache service: without it the server recomputes, so it is
    # restarted with back-off however often it dies, and never takes the server down).
    max_restarts: int | None = 5
    first_backoff_s: float = 0.2  # the wait before a restart, doubled by each crash in a row
    # A child that ran this long was healthy: its next crash starts the count over,
    # so only a crash loop stops the server, not crashes spread over days.
    stable_s: float = 10.0
    probe: Callable[[], Probe] | None = None  # made at every (re)start; None: not pinged
    silent_limit_s: float = 30.0  # alive but silent this long: killed (and restarted)
    startup_limit_s: float = 120.0  # the same, before its first answer (imports, start-up)
    # Set in the child's environment from its first instruction: what a library reads as
    # it loads (OpenMP's wait policy, engine/threads.py) cannot be set by the child itself.
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.silent_limit_s <= 0 or self.startup_limit_s <= 0:
            raise ValueError(f"{self.role}: silence limits must be positive")


class Child:
    """One supervised process."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.process: BaseProcess | None = None
        self.restarts = 0
        self.not_before = 0.0  # monotonic time of the earliest restart (crash-loop backoff)
        self.started_at = 0.0  # monotonic time of the last start
        self.pids: list[int] = []  # every pid this child ever had (for cleanup)
        self.probe: Probe | None = None
        self.silent_kills = 0

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        proc = ctx.Process(
            target=_child_main,
            args=(self.spec.role, os.getpid(), self.spec.target, self.spec.arg),
            name=f"asynchicache-{self.spec.role}",
            daemon=False,
        )
        with _environment(self.spec.env):  # a spawned child copies os.environ as it starts
            proc.start()
        self.started_at = time.monotonic()
        self.process = proc
        assert proc.pid is not None
        self.pids.append(proc.pid)
        log.info("started %s (pid %d)", self.spec.role, proc.pid)
        self._close_probe()
        if self.spec.probe is not None:
            self.probe = self.spec.probe()

    def silent(self) -> float | None:
        """Seconds it has been silent past its limit (None: within it, or not pinged)."""
        if self.probe is None:
            return None
        silent = self.probe.silent_s()
        limit = self.spec.silent_limit_s
        if not self.probe.answered:
            limit = max(limit, self.spec.startup_limit_s)
        return silent if silent > limit else None

    def kill(self) -> None:
        """SIGKILL (a stopped or hung process ignores SIGTERM) and reap it."""
        proc = self.process
        if proc is not None and proc.exitcode is None:
            proc.kill()
            proc.join(5.0)

    def _close_probe(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None

    @property
    def gave_up(self) -> bool:
        """Whether its crash loop used up its restarts (never, when they are unlimited)."""
        limit = self.spec.max_restarts
        return limit is not None and self.restarts >= limit

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL."""
        self._close_probe()
        proc = self.process
        if proc is None or proc.exitcode is not None:
            return
        proc.terminate()
        proc.join(timeout_s)
        if proc.exitcode is None:
            log.warning(
                "%s (pid %d) ignored SIGTERM for %.0fs; killing it",
                self.spec.role,
                proc.pid,
                timeout_s,
            )
            proc.kill()
            proc.join(5.0)
        log.info("%s stopped (exit code %s)", self.spec.role, proc.exitcode)


class Supervisor:
    """Starts children in order, restarts those marked `restart`, stops them in reverse."""

    def __init__(self) -> None:
        self.children: dict[str, Child] = {}
        self.stopping = False

    def start(self, spec: ChildSpec) -> Child:
        child = Child(spec)
        self.children[spec.role] = child
        child.start()
        return child

    def check(self) -> str | None:
        """Restart what may be restarted; returns the role of a dead child that may not."""
        if self.stopping:
            return None
        for role, child in self.children.items():
            if child.alive and not self._silenced(role, child):
                continue
            now = time.monotonic()
            if child.not_before == 0.0 and now - child.started_at >= child.spec.stable_s:
                child.restarts = 0  # first seen dead after a healthy run: not a crash loop
            if not child.spec.restart or child.gave_up:
                return role
            if child.not_before == 0.0:
                child.not_before = now + backoff_s(child.restarts, child.spec.first_backoff_s)
            if now < child.not_before:
                continue
            child.restarts += 1
            child.not_before = 0.0
            limit = child.spec.max_restarts
            log.error("%s died (exit code %s); restart %d%s", role, child.exitcode,
                      child.restarts, "" if limit is None else f" of {limit}")  # fmt: skip
            child.start()
        return None

    def _silenced(self, role: str, child: Child) -> bool:
        """Kill a child that stays silent past its limit; True if it was killed."""
        silent = child.silent()
        if silent is None:
            return False
        log.error(
            "%s (pid %s) alive but silent for %.1fs; killing it to restart it",
            role,
            child.process.pid if child.process else "?",
            silent,
        )
        child.silent_kills += 1
        child.kill()
        return not child.alive

    def stop_all(self, timeout_s: float) -> list[int]:
        """Stop children, last started first; returns every pid they ever had."""
        self.stopping = True
        for child in reversed(list(self.children.values())):
            child.stop(timeout_s)
        return [pid for child in self.children.values() for pid in child.pids]
