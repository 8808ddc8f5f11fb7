"""What a test run leaves in /dev/shm: our segments (`asynchicache-<pid>-...`) and Python
multiprocessing's (`psm_*` shared memory, `sem.mp-*` semaphores: vLLM's servers make them,
and their resource tracker removes them unless it is killed first).

Other programs on the machine (a benchmark, another checkout's tests) may hold segments of
their own. A segment of ours is a leftover when its owner pid is this process or dead; a
multiprocessing one when it appeared during the run and no live process maps it any more
(a live server's are mapped by it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from processes import pid_alive

from asynchicache.storage.shm import SEGMENT_PREFIX, SHM_DIR, owner_pid

MULTIPROCESSING = ("psm_", "sem.mp-")


def snapshot() -> set[str]:
    return set(os.listdir(SHM_DIR))


def mapped() -> set[str]:
    """Names of the /dev/shm files some live process maps now."""
    names: set[str] = set()
    prefix = f"{SHM_DIR}/"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                names.add(line[at + len(prefix) :].removesuffix(" (deleted)"))
    return names


def _orphaned(name: str) -> bool:
    pid = owner_pid(name)
    return pid is None or pid == os.getpid() or not pid_alive(pid)


def leftovers(before: set[str]) -> list[str]:
    """Segments that appeared since `before` and that nobody will remove."""
    new = snapshot() - before
    ours = {s for s in new if s.startswith(SEGMENT_PREFIX) and _orphaned(s)}
    theirs = {s for s in new if s.startswith(MULTIPROCESSING)}
    return sorted(ours | (theirs - mapped() if theirs else set()))


def wait_no_leftovers(before: set[str], timeout_s: float = 10.0) -> list[str]:
    """`leftovers(before)` once empty, or as they are after `timeout_s` (a cache service
    removes a killed vLLM's segment at its next sweep, a tracker needs a moment)."""
    deadline = time.monotonic() + timeout_s
    while (left := leftovers(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
