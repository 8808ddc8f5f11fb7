"""The L2 segment's slots as the scheduler side sees them: what each holds, who touches it.

Invariants (`check_integrity` makes them executable):

* a slot is FREE, WRITING (someone fills it: a service load or a worker save
  copy) or READY (holds the page `page_hash`, readable); the states live in a
  `cache.ledger.PoolLedger` with the transitions below, checked on every
  change (strict in tests), and the free list derives from them;
* a READY slot has `readers` >= 0: copies in flight that read it (a worker copy
  into vLLM's blocks, a service store). Only READY slots with no reader are
  evicted, least recently used first; a chain is touched suffix-first, so its
  prefix is the most recent and evicted last;
* one READY slot per page hash;
* a slot whose filler may still write (a load ticket completed unsettled)
  stays WRITING, and a READY slot a store may still read keeps its reader,
  until the service's `Settled` arrives: nothing that asynchronous work may
  touch is ever reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType
from typing import cast

from asynchicache.hierarchy.l2.ledger import PoolLedger, strict_from_env


class SlotUse(IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


_U = SlotUse
TRANSITIONS = MappingProxyType(
    {
        _U.FREE: frozenset({_U.WRITING}),  # allocate
        _U.WRITING: frozenset({_U.READY, _U.FREE}),  # published; released
        _U.READY: frozenset({_U.FREE}),  # evicted
    }
)


@dataclass
class _Slot:
    page_hash: bytes = b""
    readers: int = 0


class HostIndex:
    """Slots of one L2 segment: allocation, publication, reader counts and LRU eviction."""

    def __init__(self, num_slots: int) -> None:
        # SlotUse is an IntEnum: the ledger reads these transitions as its own states'.
        transitions = cast(Mapping[IntEnum, frozenset[IntEnum]], TRANSITIONS)
        self._ledger = PoolLedger("vLLM L2", num_slots, SlotUse, transitions, strict_from_env())
        self._slots = [_Slot() for _ in range(num_slots)]
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY slots, oldest first
        self._unread = 0  # READY slots with no reader (evictable), kept as readers change
        self.evictions = 0
        self.on_evict: Callable[[list[bytes]], None] | None = None  # the pages evicted

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def use(self, slot: int) -> SlotUse:
        return SlotUse(self._ledger.state(slot))

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
            if self.use(slot) is not SlotUse.READY:
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
            if self.use(slot) is not SlotUse.READY or s.readers <= 0:
                use = self.use(slot).name
                raise ValueError(f"no reader to drop on slot {slot} ({use}, {s.readers} readers)")
            s.readers -= 1
            if s.readers == 0:
                self._unread += 1

    def room(self) -> int:
        """How many slots `allocate` could take now: free ones and READY ones no one reads."""
        return self._ledger.num_free + self._unread

    def allocate(self, n: int) -> list[int] | None:
        """`n` WRITING slots, evicting unread READY pages LRU-first; None if L2 cannot."""
        short = n - self._ledger.num_free
        if short > 0 and not self._evict(short):
            return None
        return self._ledger.take(n, SlotUse.WRITING)

    def publish(self, slot: int, page_hash: bytes) -> bool:
        """WRITING -> READY holding `page_hash`. False (and the slot freed) if another
        slot already holds that page."""
        if self.use(slot) is not SlotUse.WRITING:
            raise ValueError(f"publish of slot {slot} in state {self.use(slot).name}")
        if page_hash in self._by_hash:
            self.release([slot])
            return False
        self._ledger.move([slot], SlotUse.WRITING, SlotUse.READY)
        s = self._slots[slot]
        s.page_hash, s.readers = page_hash, 0
        self._by_hash[page_hash] = slot
        self._lru[slot] = None
        self._unread += 1
        return True

    def release(self, slots: Sequence[int]) -> None:
        """WRITING -> FREE (the filler is done with them and their bytes are not wanted)."""
        for slot in slots:
            if self.use(slot) is not SlotUse.WRITING:
                raise ValueError(f"release of slot {slot} in state {self.use(slot).name}")
        self._ledger.move(slots, SlotUse.WRITING, SlotUse.FREE)

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
        self._ledger.move(victims, SlotUse.READY, SlotUse.FREE)
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
            "writing": self.num_slots - free - ready,
        }

    def check_integrity(self) -> None:
        problems = self._ledger.problems()
        assert not problems, "; ".join(problems)
        for i, s in enumerate(self._slots):
            use = self.use(i)
            assert s.readers >= 0, f"slot {i} has {s.readers} readers"
            if use is SlotUse.READY:
                assert self._by_hash.get(s.page_hash) == i, f"slot {i} not indexed"
                assert i in self._lru, f"slot {i} not in the LRU"
            else:
                assert s.readers == 0, f"slot {i} ({use.name}) has readers"
        assert len(self._by_hash) == len(self._lru), "hash index and LRU disagree"
        unread = sum(1 for slot in self._lru if self._slots[slot].readers == 0)
        assert unread == self._unread, f"{unread} unread READY slots, {self._unread} counted"
