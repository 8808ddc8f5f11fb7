"""The page ledger: the one record of what every L1 page and every L2 slot is for.

Each pool (L1 device pages, L2 host slots) has one `PoolLedger`: a state per
page, per-state counts, and the free list, which is derived from the states
(an index of the FREE pages, never edited by anyone else). Every change goes
through `take` (FREE -> a state, lowest pages first) or `move` (a page from the
states the caller expects to one the transition table allows). The table is
written once, below; an illegal change raises `LedgerError` in strict mode (the
test suite's) and otherwise is refused, counted and logged: the page keeps its
state, because a leaked page costs capacity while a wrongly reused one serves
wrong KV.

L1 pages (`PageState`):
  FREE     nobody's
  PRIVATE  handed to a running request by `allocate`; it frees or inserts them
  CACHED   listed by exactly one tree node (`node.device`)
  FILLING  reserved by a load; an L2 -> L1 copy into it may be in flight

L2 slots (`SlotState`):
  FREE               nobody's
  WRITING            a tree node's; an L1 -> L2 copy into it is in flight
  READY              a tree node's; valid bytes, not known to be persisted
  STORING            a tree node's; valid; a storage store reads it
  STORED             a tree node's; valid and persisted below L2
  LOADING            no node's; a storage read into it is in flight
  LOAD_QUARANTINED   no node's; its read timed out, but the cache service may
                     still write it: it waits for the ticket's `Settled`
  STORE_QUARANTINED  a tree node's; valid; its store timed out, but the service
                     may still read it: unevictable, bytes unchanged, until `Settled`

Why these rules make late storage work harmless: a slot becomes FREE only from
a state no asynchronous work touches (READY, STORED: eviction), from WRITING
(its in-process copy has finished), from LOADING (its read completed and is
settled) or from LOAD_QUARANTINED (its `Settled` came). A slot whose storage
work may still run is therefore never handed out again, and a quarantined
store's slot is never rewritten, so the late store reads the bytes it was
given.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from enum import IntEnum
from types import MappingProxyType

log = logging.getLogger(__name__)

STRICT_ENV = "ASYNCHICACHE_STRICT_LEDGER"


def strict_from_env() -> bool:
    """Whether illegal ledger transitions raise (the test suite sets the variable to 1)."""
    return os.environ.get(STRICT_ENV, "") == "1"


class LedgerError(RuntimeError):
    """An illegal page or slot transition (raised in strict mode)."""


class PageState(IntEnum):
    """What an L1 device page is for."""

    FREE = 0
    PRIVATE = 1
    CACHED = 2
    FILLING = 3


class SlotState(IntEnum):
    """What an L2 host slot is for."""

    FREE = 0
    WRITING = 1
    READY = 2
    STORING = 3
    STORED = 4
    LOADING = 5
    LOAD_QUARANTINED = 6
    STORE_QUARANTINED = 7


def _table(rules: dict[IntEnum, tuple[IntEnum, ...]]) -> Mapping[IntEnum, frozenset[IntEnum]]:
    return MappingProxyType({src: frozenset(dsts) for src, dsts in rules.items()})


P, S = PageState, SlotState

PAGE_TRANSITIONS = _table(
    {
        P.FREE: (P.PRIVATE, P.FILLING),  # allocate; a load reserves
        P.PRIVATE: (P.FREE, P.CACHED),  # the request frees it; insert takes it
        P.FILLING: (P.CACHED, P.FREE),  # its copy landed and a node adopts it; or not needed
        P.CACHED: (P.FREE,),  # evicted
    }
)

SLOT_TRANSITIONS = _table(
    {
        S.FREE: (S.WRITING, S.LOADING),
        S.WRITING: (S.READY, S.FREE),  # the copy landed; or failed
        S.READY: (S.STORING, S.FREE),  # a store starts; evicted
        S.STORING: (S.STORED, S.READY, S.STORE_QUARANTINED),  # stored; failed; timed out
        S.STORE_QUARANTINED: (S.READY,),  # Settled: the service reads it no more
        S.STORED: (S.FREE,),  # evicted
        S.LOADING: (S.STORED, S.FREE, S.LOAD_QUARANTINED),  # read and cached; not; timed out
        S.LOAD_QUARANTINED: (S.FREE,),  # Settled: the service writes it no more
    }
)

# Slot states that a tree node lists (`node.host`); the others belong to no node.
TREE_SLOT_STATES = frozenset({S.WRITING, S.READY, S.STORING, S.STORED, S.STORE_QUARANTINED})
QUARANTINED = frozenset({S.LOAD_QUARANTINED, S.STORE_QUARANTINED})


class PoolLedger:
    """States of the `size` pages of one pool; the free list derives from them."""

    def __init__(
        self,
        name: str,
        size: int,
        states: type[IntEnum],
        transitions: Mapping[IntEnum, frozenset[IntEnum]],
        strict: bool = False,
        on_illegal: Callable[[str], None] | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"a pool ledger needs a size >= 0, got {size}")
        self.name = name
        self.size = size
        self.states = states
        self.free_state = states(0)
        self.transitions = transitions
        self.strict = strict
        self.on_illegal = on_illegal
        self.illegal = 0
        self.changes = 0  # take/move calls that changed a state (a cheap "anything new?")
        self._state = bytearray(size)  # every page starts FREE (0)
        self._counts = [0] * len(states)
        self._counts[0] = size
        # Min-heap of exactly the FREE pages: pages leave FREE only through take().
        self._free = list(range(size))

    # -- questions ----------------------------------------------------------------------------

    def state(self, page: int) -> IntEnum:
        return self.states(self._state[page])

    def count(self, *states: IntEnum) -> int:
        return sum(self._counts[s] for s in states)

    @property
    def num_free(self) -> int:
        return self._counts[0]

    def pages_in(self, *states: IntEnum) -> list[int]:
        wanted = {int(s) for s in states}
        return [p for p, s in enumerate(self._state) if s in wanted]

    def counts(self) -> dict[str, int]:
        return {s.name.lower(): self._counts[s] for s in self.states}

    # -- changes ------------------------------------------------------------------------------

    def take(self, n: int, dst: IntEnum) -> list[int] | None:
        """The `n` lowest FREE pages, now in state `dst`; None (and no change) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot take {n} pages")
        if n > self._counts[0]:
            return None
        if dst not in self.transitions[self.free_state]:
            self._refuse([], self.free_state, dst, "not a transition from FREE")
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._state[p] = dst
        self._counts[0] -= n
        self._counts[dst] += n
        self.changes += 1
        return pages

    def move(self, pages: Iterable[int], src: IntEnum | tuple[IntEnum, ...], dst: IntEnum) -> None:
        """Pages the caller holds in `src` (one state or several) go to `dst`.

        Each page must be in `src`, `src -> dst` must be in the transition table
        and not leave FREE (only `take` does). Illegal pages raise in strict mode;
        otherwise they keep their state while the legal ones move.
        """
        pages = list(pages)
        allowed = (src,) if not isinstance(src, tuple) else src
        bad = [p for p in pages if not self._legal(p, allowed, dst)]
        if len(set(pages)) != len(pages):
            bad += [p for p in set(pages) if pages.count(p) > 1]
        if bad:
            self._refuse(bad, src, dst, "illegal transition")
            pages = [p for p in dict.fromkeys(pages) if p not in set(bad)]
        self.changes += bool(pages)
        for p in pages:
            old = self._state[p]
            self._state[p] = dst
            self._counts[old] -= 1
            self._counts[dst] += 1
            if dst == 0:
                heapq.heappush(self._free, p)

    def _legal(self, page: int, allowed: tuple[IntEnum, ...], dst: IntEnum) -> bool:
        if not 0 <= page < self.size:
            return False
        now = self.states(self._state[page])
        return now in allowed and now != self.free_state and dst in self.transitions[now]

    def _refuse(self, pages: list[int], src: object, dst: IntEnum, why: str) -> None:
        found = {p: (self.state(p).name if 0 <= p < self.size else "out of range") for p in pages}
        src_name = (
            "/".join(s.name for s in src) if isinstance(src, tuple) else getattr(src, "name", src)
        )
        msg = f"{self.name}: {why}: {src_name} -> {dst.name} for pages {found}"
        self.illegal += 1
        if self.on_illegal is not None:
            self.on_illegal(msg)
        if self.strict:
            raise LedgerError(msg)
        log.error("%s (refused; the pages keep their state)", msg)

    # -- integrity ----------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """The ledger's own consistency: counts match the states, the free index is exact."""
        out = []
        actual = [0] * len(self.states)
        for s in self._state:
            actual[s] += 1
        if actual != self._counts:
            out.append(f"{self.name}: state counts {self._counts} but states say {actual}")
        free = set(self._free)
        if len(free) != len(self._free) or free != set(self.pages_in(self.free_state)):
            out.append(f"{self.name}: the free index disagrees with the FREE states")
        return out


def device_ledger(size: int, strict: bool, on_illegal: Callable[[str], None]) -> PoolLedger:
    return PoolLedger("L1", size, PageState, PAGE_TRANSITIONS, strict, on_illegal)


def host_ledger(size: int, strict: bool, on_illegal: Callable[[str], None]) -> PoolLedger:
    return PoolLedger("L2", size, SlotState, SLOT_TRANSITIONS, strict, on_illegal)
