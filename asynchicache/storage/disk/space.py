"""Room for one namespace's pages in a folder whose capacity every writer shares.

`reserve(n)` runs under the folder's ledger lock (storage.disk.folder_ledger): it
reloads the pins, then evicts until the folder's usage plus `n` fits its
capacity, in the order of storage.disk.folder: unleased namespaces' pages,
this store's least recently used unpinned pages (suffix first), then unpinned
pages of this namespace that another live service wrote. It grants what
fits (all of `n`, or less when even that cannot make room) and adds it to the
usage; the caller gives back what it did not write (`release`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asynchicache.storage.disk.disk_pins import PinStore
from asynchicache.storage.disk.folder import FolderBudget, NamespaceLease, evict_unindexed
from asynchicache.storage.disk.folder_ledger import FolderLedger, Usage
from asynchicache.storage.disk.names import unlink_size
from asynchicache.storage.page_index import PageIndex


@dataclass
class SpaceCounters:
    evictions: int = 0  # own pages evicted (LRU)
    unindexed_evictions: int = 0  # pages of another live service on this namespace


class DiskSpace:
    """The capacity side of a `DiskBackend` (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        folder: Path,
        capacity: int,
        index: PageIndex,
        pins: PinStore,
        path_of: Callable[[bytes], Path],
    ) -> None:
        self.capacity = capacity
        self.folder = folder
        self.ledger = FolderLedger(root)
        self.budget = FolderBudget(root, folder)
        self.lease = NamespaceLease(folder)
        self.counters = SpaceCounters()
        self._index = index
        self._pins = pins
        self._path_of = path_of
        self._lock = threading.Lock()

    def reserve(self, needed: int) -> int:
        """Evict until `needed` more bytes fit; the bytes granted (added to the usage)."""
        self.lease.try_acquire()
        with self.ledger.locked() as usage:
            pinned = self.refresh_pins()
            self._make_room(usage, needed, pinned)
            granted = max(0, min(needed, self.capacity - usage.bytes))
            usage.add(granted)
            return granted

    def release(self, nbytes: int) -> None:
        """Bytes no longer on disk (files removed) or reserved and not written."""
        self.ledger.release(nbytes)

    def refresh_pins(self) -> frozenset[bytes]:
        """Reload the namespace's pins (if they changed) into the index; the pinned hashes."""
        pinned = self._pins.hashes()
        self._index.set_pins(pinned)
        return pinned

    def recount(self) -> None:
        """Count the folder (start-up), then trim it to the capacity."""
        self.ledger.recount()
        self.reserve(0)

    def close(self) -> None:
        self.ledger.close()
        self.lease.release()

    def _make_room(self, usage: Usage, needed: int, pinned: frozenset[bytes]) -> None:
        excess = usage.bytes + needed - self.capacity
        if excess > 0:
            freed = self.budget.evict_stale(excess)
            usage.add(-freed)
            excess -= freed
        while excess > 0:
            victims = self._index.pop_lru(excess)
            if not victims:
                break
            freed = sum(unlink_size(self._path_of(h), size) for h, size in victims)
            with self._lock:
                self.counters.evictions += len(victims)
            usage.add(-freed)
            excess -= freed
        if excess > 0:
            freed, deleted = evict_unindexed(self.folder, self._index, pinned, excess)
            with self._lock:
                self.counters.unindexed_evictions += deleted
            usage.add(-freed)
