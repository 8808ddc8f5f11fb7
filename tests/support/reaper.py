"""No process a test run starts outlives the run, even when pytest itself is killed.

The run gets a token in its environment (ASYNCHICACHE_TEST_RUN), which every process it
starts inherits: servers, their engines and cache services, redis-servers, vLLM, xdist
workers. A watcher process (this file run as a script, without the token) holds the read
end of a pipe whose write end only pytest has, and a pidfd of pytest; when pytest exits
in any way (SIGKILL included) either fires, and the watcher stops every process of this user whose
environment carries the token: SIGTERM, then SIGKILL after a grace period. Fixtures stop
their servers as before; this is the net under them (a killed run, a hung teardown).

`PR_SET_PDEATHSIG` in each child would not do: it fires when the *thread* that started
the child exits, and tests start servers from worker threads (`start_together`); nor a
process group, which servers leave (`start_new_session`) so that they can be stopped with
their own children.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

RUN_ENV = "ASYNCHICACHE_TEST_RUN"
GRACE_S = 10.0  # a SIGTERMed server's clean-up (shared memory, its children) fits this


def carriers(token: str) -> list[int]:
    """Pids of this user's processes (not this one) whose environment holds the token."""
    mark = f"{RUN_ENV}={token}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        if pid == os.getpid():
            continue
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:  # gone, or another user's
            continue
    return found


def sweep(token: str, grace_s: float = GRACE_S) -> list[int]:
    """Stop every carrier of `token`: SIGTERM, SIGKILL what is left after `grace_s`."""
    pids = carriers(token)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while carriers(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in carriers(token):
        _signal(pid, signal.SIGCONT)  # a test may have frozen it
        _signal(pid, signal.SIGKILL)
    return pids


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def start() -> str:
    """Give this run its token (once: xdist workers and nested runs keep the parent's) and,
    in the process that made it, start the watcher. Returns the token."""
    token = os.environ.get(RUN_ENV)
    if token:
        return token
    token = uuid.uuid4().hex
    read, write = os.pipe()  # pytest keeps `write` open until it exits, never writes
    env = {k: v for k, v in os.environ.items() if k != RUN_ENV}
    subprocess.Popen(
        [sys.executable, __file__, token, str(os.getpid())],
        stdin=read,
        env=env,
        start_new_session=True,  # a Ctrl-C to pytest's group must not stop the watcher
        close_fds=True,
    )
    os.close(read)
    os.environ[RUN_ENV] = token
    _keep(write)
    return token


def _keep(fd: int) -> None:
    """Hold the pipe's write end for the life of this process (not inherited by children:
    os.pipe's ends are non-inheritable, so only an exec-less fork keeps it)."""
    os.set_inheritable(fd, False)


def _watch(token: str, run_pid: int) -> None:
    """Sweep once the run is gone: its pipe's EOF, or its pidfd, which also fires when a
    child forked without exec (multiprocessing's fork) still holds the pipe open."""
    fds = [sys.stdin.fileno()]
    with contextlib.suppress(OSError, AttributeError):  # gone already, or an old kernel
        fds.append(os.pidfd_open(run_pid))
    while True:
        ready, _, _ = select.select(fds, [], [])
        if fds[0] in ready and not os.read(fds[0], 4096):  # nothing is ever written: EOF
            break
        if fds[1:] and fds[1] in ready:
            break
    sweep(token)


if __name__ == "__main__":
    _watch(sys.argv[1], int(sys.argv[2]))
