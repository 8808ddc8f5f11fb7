"""The in-memory index of a page store: which pages it holds, their sizes, and LRU order.

Order is least recently used first. Chains are touched from their last page to
their first, so at equal age a prefix is more recent than its suffix and the
suffix is evicted first (a prefix without its suffix is still useful; a suffix
without its prefix is dead weight).

While the store rebuilds the index from its medium (a folder scan in the
background), lookups see what is indexed so far; scanned pages enter as the
oldest and are put in order of their stored access time when the scan ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ScannedPage:
    page_hash: bytes
    size: int
    stamp_ns: int  # last access as stored on the medium (file mtime)


@dataclass(frozen=True)
class Reservation:
    """Space granted to a store: `nbytes` reserved after evicting `victims`."""

    nbytes: int
    victims: tuple[tuple[bytes, int], ...]


class PageIndex:
    """Thread-safe LRU map page hash -> stored size, with byte accounting and reservations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._reserved = 0
        self._scan_stamps: dict[bytes, int] | None = None
        # The LRU stamp each page carries on the medium (its file mtime), so that
        # reads re-stamp a page only when its stored stamp has grown stale.
        self._stored: dict[bytes, int] = {}

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    @property
    def bytes_reserved(self) -> int:
        return self._reserved

    def leading(self, hashes: Sequence[bytes]) -> int:
        """How many pages of the chain are indexed, counting from the start."""
        with self._lock:
            for i, h in enumerate(hashes):
                if h not in self._lru:
                    return i
            return len(hashes)

    def lru_order(self) -> list[bytes]:
        """Hashes from the next eviction victim to the most recently used."""
        with self._lock:
            return list(self._lru)

    def add_chain(self, pages: Sequence[tuple[bytes, int]]) -> None:
        """Insert or touch pages given in chain order; the first ends most recent.

        A page already indexed keeps its recorded size.
        """
        with self._lock:
            for h, size in reversed(pages):
                self._insert(h, size)

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        """Mark present pages used, first page most recent; absent ones are ignored."""
        with self._lock:
            for h in reversed(hashes):
                if h in self._lru:
                    self._lru.move_to_end(h)
                    self._forget_stamp(h)

    def record_stamps(self, stamps: Iterable[tuple[bytes, int]]) -> None:
        """Remember the LRU stamps just written to the medium for these pages."""
        with self._lock:
            for h, stamp_ns in stamps:
                if h in self._lru:
                    self._stored[h] = stamp_ns

    def due_stamps(self, hashes: Sequence[bytes], now_ns: int, max_age_ns: int) -> list[bytes]:
        """Indexed pages whose stored stamp is older than `max_age_ns` (or unknown)."""
        with self._lock:
            return [
                h for h in hashes if h in self._lru and now_ns - self._stored.get(h, 0) > max_age_ns
            ]

    def remove(self, page_hash: bytes) -> int | None:
        """Drop a page; returns its size, or None when it was not indexed."""
        with self._lock:
            size = self._lru.pop(page_hash, None)
            if size is not None:
                self._bytes -= size
                self._forget_stamp(page_hash)
                self._stored.pop(page_hash, None)
            return size

    def clear(self) -> list[bytes]:
        with self._lock:
            hashes = list(self._lru)
            self._lru.clear()
            self._stored.clear()
            self._bytes = 0
            return hashes

    def reserve(self, nbytes: int, capacity: int) -> Reservation:
        """Evict LRU pages until `nbytes` more fit in `capacity`; reserve what fits.

        When even an empty store cannot take `nbytes`, reserves as much as fits
        (the caller stores a prefix of its pages). The victims are already out
        of the index; the caller deletes their data.
        """
        with self._lock:
            victims = []
            while self._lru and self._bytes + self._reserved + nbytes > capacity:
                h, size = self._lru.popitem(last=False)
                self._bytes -= size
                self._forget_stamp(h)
                self._stored.pop(h, None)
                victims.append((h, size))
            granted = max(0, min(nbytes, capacity - self._bytes - self._reserved))
            self._reserved += granted
            return Reservation(granted, tuple(victims))

    def commit(
        self,
        reserved: int,
        pages: Sequence[tuple[bytes, int]],
        written: Iterable[bytes] | None = None,
    ) -> set[bytes]:
        """Release a reservation and index the pages of a store, in chain order.

        Pages in `written` (all of `pages` when None) were just written and are
        indexed; the others were skipped because they were indexed when the
        store began, and are only touched if they still are: another store may
        have evicted (and unlinked) one since, and indexing it again would make
        the index claim a page the folder no longer holds. Returns the hashes
        of `pages` that are indexed now.
        """
        fresh = None if written is None else set(written)
        indexed: set[bytes] = set()
        with self._lock:
            self._reserved -= reserved
            for h, size in reversed(pages):
                if fresh is None or h in fresh or h in self._lru:
                    self._insert(h, size)
                    indexed.add(h)
            return indexed

    def begin_scan(self) -> None:
        with self._lock:
            self._scan_stamps = {}

    def add_scanned(self, pages: Iterable[ScannedPage]) -> None:
        """Index pages found on the medium; pages already known keep their place."""
        with self._lock:
            stamps = self._scan_stamps if self._scan_stamps is not None else {}
            for page in pages:
                if page.page_hash in self._lru:
                    continue
                self._lru[page.page_hash] = page.size
                self._lru.move_to_end(page.page_hash, last=False)
                self._bytes += page.size
                stamps[page.page_hash] = page.stamp_ns
                self._stored[page.page_hash] = page.stamp_ns

    def end_scan(self) -> None:
        """Order scanned, untouched pages by stored access time, all older than the rest."""
        with self._lock:
            stamps = self._scan_stamps or {}
            self._scan_stamps = None
            old = sorted((stamps[h], h) for h in self._lru if h in stamps)
            fresh = [(h, s) for h, s in self._lru.items() if h not in stamps]
            order: OrderedDict[bytes, int] = OrderedDict((h, self._lru[h]) for _, h in old)
            order.update(fresh)
            self._lru = order

    def _insert(self, page_hash: bytes, size: int) -> None:
        if page_hash not in self._lru:
            self._lru[page_hash] = size
            self._bytes += size
        self._lru.move_to_end(page_hash)
        self._forget_stamp(page_hash)

    def _forget_stamp(self, page_hash: bytes) -> None:
        if self._scan_stamps is not None:
            self._scan_stamps.pop(page_hash, None)
