"""The in-memory index of a page store: which pages it holds, their sizes, parents and LRU order.

Order is least recently used first. Chains are touched from their last page to
their first, so at equal age a prefix is more recent than its suffix and the
suffix is evicted first (a prefix without its suffix is still useful; a suffix
without its prefix is dead weight).

Pinned pages (storage.disk.pins) sit outside the LRU order: they are indexed,
counted and found like any page, but `pop_lru` never takes them. `set_pins`
moves pages between the two as pins come and go.

Every page's parent hash is kept (16 bytes), so a clear of one chain root
(a `cache_salt`'s pages: storage.lineage) and the contents reply for a
late event subscriber need no file reads.

Every change goes to an optional `IndexListener` while the index lock is
held: the listener sees additions and removals in exactly the order the index
made them, and a `snapshot` taken under the same lock lies between two of them
(storage.events).

While the store rebuilds the index from its medium (a folder scan in the
background), lookups see what is indexed so far; scanned pages enter as the
oldest and are put in order of their stored access time when the scan ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class IndexedPage:
    """A page entering the index. `tokens` only travel to the listener (not kept)."""

    page_hash: bytes
    size: int
    parent: bytes = b""
    tokens: tuple[int, ...] = ()
    stamp_ns: int = 0  # scanned pages: last access as stored on the medium (file mtime)


class _Entry(NamedTuple):
    size: int
    parent: bytes


class IndexListener(Protocol):
    """Told of every change, under the index lock (so: cheap, and never calls back)."""

    def stored(self, pages: Sequence[IndexedPage]) -> None: ...

    def removed(self, hashes: Sequence[bytes]) -> None: ...

    def cleared(self) -> None: ...


class PageIndex:
    """Thread-safe LRU map page hash -> (size, parent), with byte accounting and pins."""

    def __init__(self, listener: IndexListener | None = None) -> None:
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, _Entry] = OrderedDict()  # evictable, oldest first
        self._pinned: dict[bytes, _Entry] = {}  # indexed and pinned
        self._pin_set: frozenset[bytes] = frozenset()
        self._bytes = 0
        self._listener = listener
        self._scan_stamps: dict[bytes, int] | None = None
        # The LRU stamp each page carries on the medium (its file mtime), so that
        # reads re-stamp a page only when its stored stamp has grown stale.
        self._stored: dict[bytes, int] = {}

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._lru or page_hash in self._pinned

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    @property
    def pinned_pages(self) -> int:
        return len(self._pinned)

    def leading(self, hashes: Sequence[bytes]) -> int:
        """How many pages of the chain are indexed, counting from the start."""
        with self._lock:
            for i, h in enumerate(hashes):
                if h not in self._lru and h not in self._pinned:
                    return i
            return len(hashes)

    def lru_order(self) -> list[bytes]:
        """Evictable hashes from the next eviction victim to the most recently used."""
        with self._lock:
            return list(self._lru)

    def parents(self) -> dict[bytes, bytes]:
        """Every indexed page's parent hash (b"" when unknown)."""
        with self._lock:
            out = {h: e.parent for h, e in self._lru.items()}
            out.update((h, e.parent) for h, e in self._pinned.items())
            return out

    def snapshot(self, mark: Callable[[], T]) -> tuple[list[tuple[bytes, bytes]], T]:
        """(hash, parent) of every page, and `mark()` taken at the same instant."""
        with self._lock:
            pages = [(h, e.parent) for h, e in self._pinned.items()]
            pages += [(h, e.parent) for h, e in self._lru.items()]
            return pages, mark()

    def add_chain(self, pages: Sequence[IndexedPage]) -> None:
        """Insert or touch pages given in chain order; the first ends most recent.

        A page already indexed keeps its recorded size.
        """
        with self._lock:
            fresh = [p for p in reversed(pages) if self._insert(p)]
            self._tell_stored(fresh[::-1])

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
                if h in self._lru or h in self._pinned:
                    self._stored[h] = stamp_ns

    def due_stamps(self, hashes: Sequence[bytes], now_ns: int, max_age_ns: int) -> list[bytes]:
        """Indexed pages whose stored stamp is older than `max_age_ns` (or unknown)."""
        with self._lock:
            return [h for h in hashes if h in self and now_ns - self._stored.get(h, 0) > max_age_ns]

    def remove(self, page_hash: bytes) -> int | None:
        """Drop a page; returns its size, or None when it was not indexed."""
        gone = self.remove_many([page_hash])
        return gone[0][1] if gone else None

    def remove_many(self, hashes: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """Drop the indexed ones of `hashes`; (hash, size) of each dropped."""
        with self._lock:
            gone = [(h, self._drop(h)) for h in hashes if h in self]
            self._tell_removed([h for h, _ in gone])
            return gone

    def clear(self) -> list[bytes]:
        """Drop every page, pinned or not; the hashes dropped."""
        with self._lock:
            hashes = [*self._lru, *self._pinned]
            self._lru.clear()
            self._pinned.clear()
            self._stored.clear()
            self._bytes = 0
            if self._listener is not None:
                self._listener.cleared()
            return hashes

    def pop_lru(self, nbytes: int) -> list[tuple[bytes, int]]:
        """Take least recently used, unpinned pages out until `nbytes` are freed (or none
        is left); (hash, size) of each. The caller deletes their data."""
        with self._lock:
            victims: list[tuple[bytes, int]] = []
            freed = 0
            while self._lru and freed < nbytes:
                h = next(iter(self._lru))
                size = self._drop(h)
                victims.append((h, size))
                freed += size
            self._tell_removed([h for h, _ in victims])
            return victims

    def commit(self, pages: Sequence[IndexedPage], written: Iterable[bytes]) -> set[bytes]:
        """Index the pages of a store, in chain order.

        Pages in `written` were just written and are indexed; the others were
        skipped because they were indexed when the store began, and are only
        touched if they still are: another store may have evicted (and
        unlinked) one since, and indexing it again would make the index claim
        a page the folder no longer holds. Returns the hashes of `pages` that
        are indexed now.
        """
        fresh_set = set(written)
        indexed: set[bytes] = set()
        with self._lock:
            fresh = []
            for p in reversed(pages):
                if p.page_hash in fresh_set or p.page_hash in self:
                    if self._insert(p):
                        fresh.append(p)
                    indexed.add(p.page_hash)
            self._tell_stored(fresh[::-1])
            return indexed

    def set_pins(self, pinned: frozenset[bytes]) -> None:
        """Make exactly `pinned` exempt from `pop_lru` (present ones now, the rest on insert).

        Pages that lose their pin rejoin the LRU order as the most recent.
        """
        with self._lock:
            if pinned == self._pin_set:
                return
            for h in [h for h in self._pinned if h not in pinned]:
                self._lru[h] = self._pinned.pop(h)
            for h in pinned:
                entry = self._lru.pop(h, None)
                if entry is not None:
                    self._pinned[h] = entry
            self._pin_set = pinned

    def begin_scan(self) -> None:
        with self._lock:
            self._scan_stamps = {}

    def add_scanned(self, pages: Iterable[IndexedPage]) -> None:
        """Index pages found on the medium; pages already known keep their place."""
        with self._lock:
            stamps = self._scan_stamps if self._scan_stamps is not None else {}
            fresh = []
            for page in pages:
                if page.page_hash in self:
                    continue
                self._insert(page)
                if page.page_hash in self._lru:
                    self._lru.move_to_end(page.page_hash, last=False)
                stamps[page.page_hash] = page.stamp_ns
                self._stored[page.page_hash] = page.stamp_ns
                fresh.append(page)
            self._tell_stored(fresh)

    def end_scan(self) -> None:
        """Order scanned, untouched pages by stored access time, all older than the rest."""
        with self._lock:
            stamps = self._scan_stamps or {}
            self._scan_stamps = None
            old = sorted((stamps[h], h) for h in self._lru if h in stamps)
            fresh = [(h, e) for h, e in self._lru.items() if h not in stamps]
            order: OrderedDict[bytes, _Entry] = OrderedDict((h, self._lru[h]) for _, h in old)
            order.update(fresh)
            self._lru = order

    # -- under the lock ------------------------------------------------------

    def _insert(self, page: IndexedPage) -> bool:
        """Insert or touch; whether the page is new."""
        h = page.page_hash
        new = h not in self._lru and h not in self._pinned
        if new:
            entry = _Entry(page.size, page.parent)
            self._bytes += page.size
            if h in self._pin_set:
                self._pinned[h] = entry
            else:
                self._lru[h] = entry
        elif page.parent and not self._entry(h).parent:  # adopted: the parent read since
            self._set(h, _Entry(self._entry(h).size, page.parent))
        if h in self._lru:
            self._lru.move_to_end(h)
        self._forget_stamp(h)
        return new

    def _entry(self, page_hash: bytes) -> _Entry:
        return self._lru.get(page_hash) or self._pinned[page_hash]

    def _set(self, page_hash: bytes, entry: _Entry) -> None:
        if page_hash in self._lru:
            self._lru[page_hash] = entry
        else:
            self._pinned[page_hash] = entry

    def _drop(self, page_hash: bytes) -> int:
        entry = self._lru.pop(page_hash, None) or self._pinned.pop(page_hash)
        self._bytes -= entry.size
        self._forget_stamp(page_hash)
        self._stored.pop(page_hash, None)
        return entry.size

    def _forget_stamp(self, page_hash: bytes) -> None:
        if self._scan_stamps is not None:
            self._scan_stamps.pop(page_hash, None)

    def _tell_stored(self, pages: Sequence[IndexedPage]) -> None:
        if pages and self._listener is not None:
            self._listener.stored(pages)

    def _tell_removed(self, hashes: Sequence[bytes]) -> None:
        if hashes and self._listener is not None:
            self._listener.removed(hashes)
