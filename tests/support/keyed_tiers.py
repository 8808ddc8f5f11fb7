"""Disk and Redis tiers opened with a key file's secrets (tests of page MACs and encryption).

`KeyedTiers` opens backends on one shared folder or one Redis, each with the secrets it
is given (none: a writer or reader without a key file) and encrypting or not, and closes
them all at the end: several instances sharing a tier, as in a fleet.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pools import NAMESPACE, SMALL, Pool

from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.page_keys import PageKeys
from asynchicache.storage.remote.remote_backend import RedisBackend, RedisConfig

Backend = DiskBackend | RedisBackend


class KeyedTiers:
    """`open(*secrets, encrypt=..., layout=...)` backends of one tier; `close()` them all."""

    def __init__(self, opener: Callable[[PageKeys | None, PageLayout], Backend], encrypt: bool):
        self._opener = opener
        self._encrypt = encrypt  # when a call does not say
        self.opened: list[Backend] = []

    def open(
        self, *secrets: bytes, encrypt: bool | None = None, layout: PageLayout = SMALL
    ) -> Backend:
        chosen = self._encrypt if encrypt is None else encrypt
        keys = PageKeys(secrets, chosen) if secrets else None
        self.opened.append(self._opener(keys, layout))
        return self.opened[-1]

    def close(self) -> None:
        for backend in self.opened:
            backend.close()


def disk_tiers(folder: Path, encrypt: bool) -> KeyedTiers:
    def opener(keys: PageKeys | None, layout: PageLayout) -> Backend:
        return DiskBackend(DiskConfig(folder, NAMESPACE, layout, 1 << 30, keys=keys))

    return KeyedTiers(opener, encrypt)


def redis_tiers(url: str, encrypt: bool) -> KeyedTiers:
    def opener(keys: PageKeys | None, layout: PageLayout) -> Backend:
        backend = RedisBackend(RedisConfig(url, NAMESPACE, layout, retry_initial_s=0.1, keys=keys))
        assert backend.wait_available(10.0)
        return backend

    return KeyedTiers(opener, encrypt)


def read_back(backend: Backend, hashes: list[bytes], pool: Pool) -> int:
    """Pages of `hashes` read into slots 8, 9, ... of `pool`; how many were served."""
    return backend.get(hashes, list(range(8, 8 + len(hashes))), pool.array)


def mac_failures(backend: Backend) -> float:
    return backend.stats().extra.get("mac_failures", 0.0)
