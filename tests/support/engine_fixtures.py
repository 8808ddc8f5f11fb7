"""Engines for the tests that run the real model in this process, and the checks every
`engines` fixture makes when a test is done with them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from asynchicache.engine.engine import Engine
from asynchicache.settings.config import CacheConfig, EngineConfig

if TYPE_CHECKING:
    from asynchicache.model.loader import LoadedModel


def l1_only_engine(model: LoadedModel, device_cache_tokens: int) -> Engine:
    """An engine on `model` whose cache is L1 alone, `device_cache_tokens` of it."""
    cache = CacheConfig(
        disk_cache_dir=None, host_cache_gb=0, device_cache_tokens=device_cache_tokens
    )
    return Engine(EngineConfig(), cache, loaded=model)


def checked_engines(l1_released: bool = True) -> Iterator[list[Engine]]:
    """Yields a list the test appends its engines to; then each is checked (integrity and,
    with `l1_released`, no L1 page left in use) and closed, with its storage."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.cache.check_integrity()
        if l1_released:
            assert engine.cache.stats().device.in_use == 0, "a finished request kept L1 pages"
        engine.close()
        if engine.cache.storage is not None:
            engine.cache.storage.close()
