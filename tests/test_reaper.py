"""A process the test run starts never outlives it, even when pytest is killed
(tests/support/reaper.py): the run's token, inherited by every process it starts, and a
watcher that stops them all once the run's process is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import reaper
from processes import pid_alive
from settling import wait_until

SUPPORT = Path(__file__).with_name("support")

# A stand-in for a test run: takes a token, starts a child that would run for ten
# minutes (in its own session, as servers do), forks a copy of itself without exec (as
# multiprocessing's fork does: it holds the watcher's pipe open), says both pids, waits.
RUN = f"""
import os, subprocess, sys, time
sys.path.insert(0, {str(SUPPORT)!r})
import reaper
reaper.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
forked = os.fork()
if forked == 0:
    time.sleep(600)
    os._exit(0)
print(child.pid, forked, flush=True)
time.sleep(600)
"""


def test_this_run_has_a_token_its_children_inherit() -> None:
    token = os.environ.get(reaper.RUN_ENV)
    assert token, "tests/conftest.py gives the run its token"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert wait_until(lambda: child.pid in reaper.carriers(token), "the child's token")
    finally:
        child.kill()
        child.wait()


def test_a_killed_run_leaves_no_process_behind() -> None:
    env = {k: v for k, v in os.environ.items() if k != reaper.RUN_ENV}  # a run of its own
    run = subprocess.Popen(
        [sys.executable, "-c", RUN], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    assert run.stdout is not None
    child, forked = map(int, run.stdout.readline().split())
    try:
        time.sleep(0.5)
        assert pid_alive(child)
        run.send_signal(signal.SIGKILL)  # no teardown, no atexit: the watcher alone
        run.wait()
        # Stopped although the fork still holds the pipe (the watcher's pidfd of the run).
        wait_until(lambda: not pid_alive(child), "the killed run's child to be stopped", 30)
    finally:
        for pid in (child, forked):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
