"""Child process bodies for the supervisor tests (importable by the spawn context, which
imports a target's module again in every child: a light module here, not a test file, keeps
each (re)start short)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from asynchicache.launch.supervisor import ChildSpec, Supervisor


def sleep_forever(pid_file: Path) -> None:
    """Append this process's pid to `pid_file`, then sleep until killed."""
    with pid_file.open("a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(0.1)


def sleep_with_env(pid_file: Path) -> None:
    """`sleep_forever`, after writing this process's OMP_WAIT_POLICY next to `pid_file`."""
    pid_file.with_suffix(".env").write_text(os.environ.get("OMP_WAIT_POLICY", "<unset>"))
    sleep_forever(pid_file)


def ignore_sigterm(pid_file: Path) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleep_forever(pid_file)


def orphan_maker(pid_file: Path) -> None:
    """A parent that starts a child and then dies without cleaning up (kill -9 style)."""
    sup = Supervisor()
    sup.start(ChildSpec("engine", sleep_forever, pid_file))
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("child started", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    orphan_maker(Path(sys.argv[1]))
