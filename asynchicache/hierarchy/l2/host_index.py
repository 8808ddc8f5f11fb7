"""`HostIndex`: L2 slots indexed by page hash, for a user of L2 without our radix tree.

The vLLM connector's scheduler side keeps its L2 segment here (our hierarchy keeps
its slots in its tree's nodes): what each slot holds, who touches it. Its states,
ledger and storage tickets are the hierarchy's own (ledger.py, slot_tickets.py).

Invariants (`check_integrity` makes them executable):

* a slot is FREE, WRITING (a worker's save copy fills it), LOADING (a service
  read fills it), LOAD_QUARANTINED (its read ended unsettled: the service may
  still write it) or READY (holds the page `page_hash`, readable). These are our
  hierarchy's L2 slot states (`hierarchy.l2.ledger.SlotState`, one vocabulary for
  both users of L2), kept in its `PoolLedger` with the connector's transitions
  below, checked on every change (strict in tests); the free list derives from them;
* a READY slot has `readers` >= 0: copies in flight that read it (a worker copy
  into vLLM's blocks, a service store). Only READY slots with no reader are
  evicted, least recently used first; a chain is touched suffix-first, so its
  prefix is the most recent and evicted last;
* one READY slot per page hash;
* a slot whose filler may still write (a load ticket completed unsettled) is
  LOAD_QUARANTINED, and a READY slot a store may still read keeps its reader,
  until the service's `Settled` arrives (host_tier.py books both in the shared
  `SlotTickets`): nothing that asynchronous work may touch is ever reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType
from typing import cast

from asynchicache.hierarchy.l2.ledger import PoolLedger, SlotState, strict_from_env

_S = SlotState
TRANSITIONS = MappingProxyType(
    {
        _S.FREE: frozenset({_S.WRITING, _S.LOADING}),  # allocated for a save copy; a read
        _S.WRITING: frozenset({_S.READY, _S.FREE}),  # published; released
        _S.LOADING: frozenset({_S.READY, _S.FREE, _S.LOAD_QUARANTINED}),  # landed; not; late
        _S.LOAD_QUARANTINED: frozenset({_S.FREE}),  # Settled: the service writes it no more
        _S.READY: frozenset({_S.FREE}),  # evicted
    }
)
_FILLING = (_S.WRITING, _S.LOADING)  # someone fills the slot; `publish` or `release` ends it


@dataclass
class _Slot:
    page_hash: bytes = b""
    readers: int = 0


class HostIndex:
    """Slots of one L2 segment: allocation, publication, reader counts and LRU eviction."""

    def __init__(self, num_slots: int) -> None:
        transitions = cast(Mapping[IntEnum, frozenset[IntEnum]], TRANSITIONS)
        self._ledger = PoolLedger("vLLM L2", num_slots, SlotState, transitions, strict_from_env())
        self._slots = [_Slot() for _ in range(num_slots)]
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY slots, oldest first
        self._unread = 0  # READY slots with no reader (evictable), kept as readers change
        self.evictions = 0
        self.on_evict: Callable[[list[bytes]], None] | None = None  # the pages evicted

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def use(self, slot: int) -> SlotState:
        return SlotState(self._ledger.state(slot))

    def readers(self, slot: int) -> int:
        return self._slots[slot].readers

    def slot_of(self, page_hash: bytes) -> int | None:
        return self._by_hash.get(page_hash)

    def leading(self, hashes: Sequence[bytes]) -> list[int]:
        """READY slots of the leading pages of `hashes` that L2 holds."""
        out = []
        for h in hashes:
            slot = self._by_hash.get(h)
            if slot is None:
                break
            out.append(slot)
        return out

    def add_readers(self, slots: Sequence[int]) -> None:
        """One more reader on each READY slot (touched suffix-first): a slot with readers is
        not evicted. (The cache's lock; not an admin pin, which this index has none of.)"""
        for slot in slots:
            if self.use(slot) is not SlotState.READY:
                raise ValueError(f"a reader on slot {slot} in state {self.use(slot).name}")
            s = self._slots[slot]
            if s.readers == 0:
                self._unread -= 1
            s.readers += 1
        self._touch(slots)

    def drop_readers(self, slots: Sequence[int]) -> None:
        """One reader less on each slot (`add_readers`' pair)."""
        for slot in slots:
            s = self._slots[slot]
            if self.use(slot) is not SlotState.READY or s.readers <= 0:
                use = self.use(slot).name
                raise ValueError(f"no reader to drop on slot {slot} ({use}, {s.readers} readers)")
            s.readers -= 1
            if s.readers == 0:
                self._unread += 1

    def room(self) -> int:
        """How many slots `allocate` could take now: free ones and READY ones no one reads."""
        return self._ledger.num_free + self._unread

    def allocate(self, n: int, state: SlotState = SlotState.WRITING) -> list[int] | None:
        """`n` slots in `state` (WRITING for a save copy, LOADING for a service read),
        evicting unread READY pages LRU-first; None if L2 cannot."""
        if state not in _FILLING:
            raise ValueError(f"slots are allocated WRITING or LOADING, not {state.name}")
        short = n - self._ledger.num_free
        if short > 0 and not self._evict(short):
            return None
        return self._ledger.take(n, state)

    def publish(self, slot: int, page_hash: bytes) -> bool:
        """WRITING or LOADING -> READY holding `page_hash`. False (and the slot freed) if
        another slot already holds that page."""
        if self.use(slot) not in _FILLING:
            raise ValueError(f"publish of slot {slot} in state {self.use(slot).name}")
        if page_hash in self._by_hash:
            self.release([slot])
            return False
        self._ledger.move([slot], _FILLING, SlotState.READY)
        s = self._slots[slot]
        s.page_hash, s.readers = page_hash, 0
        self._by_hash[page_hash] = slot
        self._lru[slot] = None
        self._unread += 1
        return True

    def release(self, slots: Sequence[int]) -> None:
        """WRITING, LOADING or LOAD_QUARANTINED -> FREE (the filler is done with them, or
        the service settled their read, and their bytes are not wanted)."""
        done = (*_FILLING, SlotState.LOAD_QUARANTINED)
        for slot in slots:
            if self.use(slot) not in done:
                raise ValueError(f"release of slot {slot} in state {self.use(slot).name}")
        self._ledger.move(slots, done, SlotState.FREE)

    def quarantine(self, slots: Sequence[int]) -> None:
        """LOADING -> LOAD_QUARANTINED: their read ended unsettled; the service may still
        write them until its `Settled` (then `release`)."""
        for slot in slots:
            if self.use(slot) is not SlotState.LOADING:
                raise ValueError(f"quarantine of slot {slot} in state {self.use(slot).name}")
        self._ledger.move(slots, SlotState.LOADING, SlotState.LOAD_QUARANTINED)

    def _touch(self, slots: Sequence[int]) -> None:
        for slot in reversed(slots):  # suffix first: the chain's prefix ends most recent
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def _evict(self, n: int) -> bool:
        victims = [slot for slot in self._lru if self._slots[slot].readers == 0][:n]
        if len(victims) < n:
            return False
        hashes = []
        for slot in victims:
            s = self._slots[slot]
            hashes.append(s.page_hash)
            del self._by_hash[s.page_hash]
            del self._lru[slot]
            s.page_hash = b""
        self._ledger.move(victims, SlotState.READY, SlotState.FREE)
        self._unread -= len(victims)
        self.evictions += len(victims)
        if self.on_evict is not None:
            self.on_evict(hashes)
        return True

    def counts(self) -> dict[str, int]:
        ready = len(self._lru)
        read = sum(1 for slot in self._lru if self._slots[slot].readers)
        free = self._ledger.num_free
        return {
            "free": free,
            "ready": ready,
            "read": read,  # READY slots with readers
            "writing": self.num_slots - free - ready,  # filled: save copies, reads, quarantined
            "quarantined": self._ledger.count(SlotState.LOAD_QUARANTINED),
        }

    def check_integrity(self) -> None:
        problems = self._ledger.problems()
        assert not problems, "; ".join(problems)
        for i, s in enumerate(self._slots):
            use = self.use(i)
            assert s.readers >= 0, f"slot {i} has {s.readers} readers"
            if use is SlotState.READY:
                assert self._by_hash.get(s.page_hash) == i, f"slot {i} not indexed"
                assert i in self._lru, f"slot {i} not in the LRU"
            else:
                assert s.readers == 0, f"slot {i} ({use.name}) has readers"
        assert len(self._by_hash) == len(self._lru), "hash index and LRU disagree"
        unread = sum(1 for slot in self._lru if self._slots[slot].readers == 0)
        assert unread == self._unread, f"{unread} unread READY slots, {self._unread} counted"
