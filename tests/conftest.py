"""Suite-wide checks: no shared-memory segment of ours outlives the tests."""

from collections.abc import Iterator

import pytest

from asynchicache.storage.shm import list_segments


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = set(list_segments())
    yield
    leaked = set(list_segments()) - before
    assert not leaked, f"shared-memory segments leaked by the test suite: {sorted(leaked)}"
