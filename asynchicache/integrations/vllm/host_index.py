"""The L2 segment's slots as the scheduler side sees them: what each holds, who touches it.

Invariants (`check_integrity` makes them executable):

* a slot is FREE (in the allocator), WRITING (someone fills it: a service load
  or a worker save copy) or READY (holds the page `page_hash`, readable);
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

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto


class SlotUse(Enum):
    FREE = auto()
    WRITING = auto()
    READY = auto()


@dataclass
class _Slot:
    use: SlotUse = SlotUse.FREE
    page_hash: bytes = b""
    readers: int = 0


class _FreeSlots:
    """Free slot numbers, lowest handed out first (the segment's first slots are
    prefaulted at start; a compact pool also keeps a request's slots in runs).
    Double frees are caught by `HostIndex`'s slot states, not here."""

    def __init__(self, num_slots: int) -> None:
        self._heap = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._heap)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._heap):
            raise ValueError(f"asked for {n} slots, {len(self._heap)} free")
        return [heapq.heappop(self._heap) for _ in range(n)]

    def free(self, slots: Sequence[int]) -> None:
        for slot in slots:
            heapq.heappush(self._heap, slot)

    def free_pages(self) -> list[int]:
        return list(self._heap)


class HostIndex:
    """Slots of one L2 segment: allocation, publication, pins and LRU eviction."""

    def __init__(self, num_slots: int) -> None:
        self._alloc = _FreeSlots(num_slots)
        self._slots = [_Slot() for _ in range(num_slots)]
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY slots, oldest first
        self.evictions = 0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def use(self, slot: int) -> SlotUse:
        return self._slots[slot].use

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

    def pin(self, slots: Sequence[int]) -> None:
        """One more reader on each READY slot (touched suffix-first)."""
        for slot in slots:
            s = self._slots[slot]
            if s.use is not SlotUse.READY:
                raise ValueError(f"pin of slot {slot} in state {s.use.name}")
            s.readers += 1
        self._touch(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            s = self._slots[slot]
            if s.use is not SlotUse.READY or s.readers <= 0:
                raise ValueError(f"unpin of slot {slot} ({s.use.name}, {s.readers} readers)")
            s.readers -= 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` WRITING slots, evicting unread READY pages LRU-first; None if L2 cannot."""
        short = n - self._alloc.num_free
        if short > 0 and not self._evict(short):
            return None
        slots = self._alloc.allocate(n)
        for slot in slots:
            self._slots[slot].use = SlotUse.WRITING
        return slots

    def publish(self, slot: int, page_hash: bytes) -> bool:
        """WRITING -> READY holding `page_hash`. False (and the slot freed) if another
        slot already holds that page."""
        s = self._slots[slot]
        if s.use is not SlotUse.WRITING:
            raise ValueError(f"publish of slot {slot} in state {s.use.name}")
        if page_hash in self._by_hash:
            self.release([slot])
            return False
        s.use, s.page_hash, s.readers = SlotUse.READY, page_hash, 0
        self._by_hash[page_hash] = slot
        self._lru[slot] = None
        return True

    def release(self, slots: Sequence[int]) -> None:
        """WRITING -> FREE (the filler is done with them and their bytes are not wanted)."""
        for slot in slots:
            s = self._slots[slot]
            if s.use is not SlotUse.WRITING:
                raise ValueError(f"release of slot {slot} in state {s.use.name}")
            s.use = SlotUse.FREE
        self._alloc.free(slots)

    def _touch(self, slots: Sequence[int]) -> None:
        for slot in reversed(slots):  # suffix first: the chain's prefix ends most recent
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def _evict(self, n: int) -> bool:
        victims = [slot for slot in self._lru if self._slots[slot].readers == 0][:n]
        if len(victims) < n:
            return False
        for slot in victims:
            s = self._slots[slot]
            del self._by_hash[s.page_hash]
            del self._lru[slot]
            s.use, s.page_hash = SlotUse.FREE, b""
        self._alloc.free(victims)
        self.evictions += len(victims)
        return True

    def counts(self) -> dict[str, int]:
        ready = len(self._lru)
        pinned = sum(1 for slot in self._lru if self._slots[slot].readers)
        free = self._alloc.num_free
        return {"free": free, "ready": ready, "pinned": pinned,
                "writing": self.num_slots - free - ready}

    def check_integrity(self) -> None:
        free = set(self._alloc.free_pages())
        for i, s in enumerate(self._slots):
            assert (s.use is SlotUse.FREE) == (i in free), f"slot {i}: {s.use} vs allocator"
            assert s.readers >= 0, f"slot {i} has {s.readers} readers"
            if s.use is SlotUse.READY:
                assert self._by_hash.get(s.page_hash) == i, f"slot {i} not indexed"
                assert i in self._lru, f"slot {i} not in the LRU"
            else:
                assert s.readers == 0, f"slot {i} ({s.use}) has readers"
        assert len(self._by_hash) == len(self._lru), "hash index and LRU disagree"
