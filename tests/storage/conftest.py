"""Fixtures for the storage tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from storage_helpers import SMALL, Pool

from asynchicache.storage.base import PageLayout


@pytest.fixture
def make_pool() -> Iterator[Callable[..., Pool]]:
    """Pools are real shared-memory segments, closed (and unlinked) after the test."""
    pools: list[Pool] = []

    def make(slots: int, layout: PageLayout = SMALL) -> Pool:
        pools.append(Pool(slots, layout))
        return pools[-1]

    yield make
    for p in pools:
        p.close()
