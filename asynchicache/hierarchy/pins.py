"""`PinnedPages`: the chains the host tier (L2) keeps, whatever else it evicts.

A pin names a chain of pages from its root (a prompt's page hashes, under the
namespace's or a `cache_salt`'s root). The cache service keeps the same pins as
files in the disk folder (storage.disk.pins), where they bind L3 for every server
on the folder and survive restarts; the engine holds a copy here, refreshed
from the service's listing, so that L2 eviction skips those pages too. L1 may
still evict a pinned page: its L2 copy stays.

Pins are prefix chains, so on any path of the tree the pinned pages are a
prefix of it: a node's pinned pages are its leading ones (`leading`), and a
node whose first page is not pinned has none. Expiry is wall-clock time
(`time.time()`), the same clock the pin files use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PinnedChain:
    """One pin as the cache sees it: its id (the last page's hash, hex), its pages, and when
    it expires (unix time; None: until unpinned)."""

    pin_id: str
    pages: tuple[bytes, ...]
    expires_at: float | None = None
    owner: str = ""  # the tenant, as storage.tenant_key fingerprints its salt

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class PinnedPages:
    """The pinned chains and the set of their pages (scheduler thread only)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._chains: dict[str, PinnedChain] = {}
        self._pages: frozenset[bytes] = frozenset()
        self._next_expiry: float | None = None

    def add(self, chain: PinnedChain) -> None:
        """Pin a chain (pinning the same chain again replaces it: a new TTL)."""
        self._chains[chain.pin_id] = chain
        self._rebuild()

    def remove(self, pin_ids: Iterable[str]) -> int:
        """Unpin by id; returns how many were pinned."""
        gone = [pid for pid in pin_ids if self._chains.pop(pid, None) is not None]
        if gone:
            self._rebuild()
        return len(gone)

    def replace(self, chains: Iterable[PinnedChain]) -> None:
        """Take the cache service's listing as the truth (other servers pin on the folder too)."""
        self._chains = {c.pin_id: c for c in chains}
        self._rebuild()

    def clear(self, pin_ids: Iterable[str] | None = None) -> None:
        """Drop these pins (None: all), as a clear that includes pinned pages does."""
        if pin_ids is None:
            self._chains = {}
        else:
            for pid in pin_ids:
                self._chains.pop(pid, None)
        self._rebuild()

    def chains(self) -> list[PinnedChain]:
        self._expire()
        return list(self._chains.values())

    @property
    def num_pages(self) -> int:
        """Distinct pinned pages (whether cached anywhere or not)."""
        self._expire()
        return len(self._pages)

    def __contains__(self, page_hash: bytes) -> bool:
        self._expire()
        return page_hash in self._pages

    def leading(self, hashes: Sequence[bytes]) -> int:
        """How many leading pages of a node's run are pinned (pins are prefix chains)."""
        self._expire()
        if not self._pages or not hashes or hashes[0] not in self._pages:
            return 0
        n = 1
        while n < len(hashes) and hashes[n] in self._pages:
            n += 1
        return n

    def new_pages(self, hashes: Iterable[bytes]) -> int:
        """Pages of `hashes` not pinned yet (what a new pin would add)."""
        self._expire()
        return len(set(hashes) - self._pages)

    def _expire(self) -> None:
        if self._next_expiry is None or self._clock() < self._next_expiry:
            return
        now = self._clock()
        self._chains = {k: c for k, c in self._chains.items() if not c.expired(now)}
        self._rebuild()

    def _rebuild(self) -> None:
        self._pages = frozenset(h for c in self._chains.values() for h in c.pages)
        expiries = [c.expires_at for c in self._chains.values() if c.expires_at is not None]
        self._next_expiry = min(expiries) if expiries else None
