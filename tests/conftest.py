"""Suite-wide checks: no shared-memory segment of ours outlives the tests; a strict page ledger."""

import os
from collections.abc import Iterator

import pytest

from asynchicache.cache.ledger import STRICT_ENV
from asynchicache.storage.shm import list_segments, owner_pid

# An illegal page or slot transition raises in every cache the tests build, in
# this process and in the servers it starts (production only counts and logs it).
os.environ.setdefault(STRICT_ENV, "1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ours_or_orphaned(name: str) -> bool:
    # Other programs on the machine (a benchmark, another checkout's tests) may
    # hold segments of their own; a segment is a leak of this suite when this
    # process created it or its creator died without removing it.
    pid = owner_pid(name)
    return pid is None or pid == os.getpid() or not _alive(pid)


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = set(list_segments())
    yield
    leaked = {s for s in set(list_segments()) - before if _ours_or_orphaned(s)}
    assert not leaked, f"shared-memory segments leaked by the test suite: {sorted(leaked)}"
