"""What a test run leaves in /dev/shm: our segments (`asynchicache-<pid>-...`) and Python
multiprocessing's (`psm_*` shared memory, `sem.mp-*` semaphores: vLLM's servers make them,
and their resource tracker removes them unless it is killed first).

Other programs on the machine (a benchmark, another checkout's tests) may hold segments of
their own. A segment of ours is a leftover when its owner pid is this process or dead; a
multiprocessing one when it appeared during the run and no live process maps it any more
(a live server's are mapped by it). Those are named at random: on a shared machine another
program's may show up too, so only the sessions that start vLLM servers check them
(tests/vllm/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from processes import pid_alive

from asynchicache.common.shm import SEGMENT_PREFIX, SHM_DIR, owner_pid

MULTIPROCESSING = ("psm_", "sem.mp-")


def snapshot() -> set[str]:
    return set(os.listdir(SHM_DIR))


def mapped() -> set[str]:
    """Names of the /dev/shm files some live process maps now. Matched by inode: glibc's
    sem_open maps a temporary name it then links under the real one."""
    inodes: set[int] = set()
    prefix = f" {SHM_DIR}/"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            if prefix in line:
                inodes.add(int(line.split()[4]))
    names = set()
    for name in os.listdir(SHM_DIR):
        with contextlib.suppress(OSError):
            if (SHM_DIR / name).stat().st_ino in inodes:
                names.add(name)
    return names


def _orphaned(name: str) -> bool:
    pid = owner_pid(name)
    return pid is None or pid == os.getpid() or not pid_alive(pid)


def leftovers(before: set[str], multiprocessing: bool = True) -> list[str]:
    """Segments that appeared since `before` and that nobody will remove: ours, and
    (`multiprocessing`) Python multiprocessing's."""
    new = snapshot() - before
    ours = {s for s in new if s.startswith(SEGMENT_PREFIX) and _orphaned(s)}
    theirs = {s for s in new if multiprocessing and s.startswith(MULTIPROCESSING)}
    return sorted(ours | (theirs - mapped() if theirs else set()))


def wait_no_leftovers(
    before: set[str], multiprocessing: bool = True, timeout_s: float = 10.0
) -> list[str]:
    """`leftovers(before)` once empty, or as they are after `timeout_s` (a cache service
    removes a killed vLLM's segment at its next sweep, a tracker needs a moment)."""
    deadline = time.monotonic() + timeout_s
    while (left := leftovers(before, multiprocessing)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
