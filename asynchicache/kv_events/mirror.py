"""`StorageMirror`: what the disk and remote tiers hold, as the engine learns it from events.

The cache service numbers its L3/L4 events (storage.events) and sends them to
an engine that subscribed; the engine keeps the set of pages per tier (with
each page's parent and tokens, for a late subscriber's replay) and relays the
events. When it has lost some (`EventBatch.gap`, or before its first sync) it
asks the service for the tiers' contents (exact at event number `seq`), turns
the difference with what it held into events, and applies only the events
numbered after `seq` from then on.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from asynchicache.common.tiers import (
    STORAGE_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Tier,
    TierEvent,
)
from asynchicache.storage.admin_messages import ContentsReply


@dataclass(frozen=True)
class MirroredPage:
    parent: bytes  # b"": not known
    tokens: bytes  # the page's token ids as uint32 (b"": not known)

    def token_ids(self) -> tuple[int, ...]:
        return tuple(array("I", self.tokens))


class StorageMirror:
    """Pages per storage tier; `floor`: events numbered up to it are already in."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.tiers: dict[str, dict[bytes, MirroredPage]] = {t: {} for t in STORAGE_TIERS}
        self.floor = 0

    def counts(self) -> dict[str, int]:
        return {t: len(pages) for t, pages in self.tiers.items()}

    def apply(self, numbered: Iterable[tuple[int, TierEvent]]) -> list[TierEvent]:
        """Take events numbered after `floor`; returns them (to relay)."""
        out = []
        for number, event in numbered:
            if number <= self.floor:
                continue
            self.floor = number
            if event.tier in self.tiers:
                self._apply(event)
                out.append(event)
        return out

    def _apply(self, event: TierEvent) -> None:
        pages = self.tiers[event.tier]
        if isinstance(event, BlockStored):
            ps = self.page_size
            parents = [event.parent_block_hash or b"", *event.block_hashes[:-1]]
            known = len(event.token_ids) == ps * len(event.block_hashes)
            for i, h in enumerate(event.block_hashes):
                run = event.token_ids[i * ps : (i + 1) * ps]
                pages[h] = MirroredPage(parents[i], array("I", run).tobytes() if known else b"")
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                pages.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            pages.clear()

    def resync(self, reply: ContentsReply) -> list[TierEvent]:
        """Take the service's contents as the truth; returns the events that turn what was
        held into it. Events numbered up to `reply.seq` are in it."""
        fresh: dict[str, dict[bytes, MirroredPage]] = {t: {} for t in STORAGE_TIERS}
        for h, parent in zip(reply.disk_hashes, reply.disk_parents, strict=False):
            fresh[Tier.DISK][h] = self._known(h, Tier.DISK, parent)
        if reply.remote_listed:
            for h in reply.remote_hashes:
                fresh[Tier.REMOTE][h] = self._known(h, Tier.REMOTE, b"")
        events: list[TierEvent] = []
        for tier in STORAGE_TIERS:
            gone = set(self.tiers[tier]) - set(fresh[tier])
            if gone:
                events.append(BlockRemoved(tier, tuple(sorted(gone))))
            for h, page in fresh[tier].items():
                if h not in self.tiers[tier]:
                    events.append(self._stored(tier, h, page))
        self.tiers = fresh
        self.floor = reply.seq
        return events

    def _known(self, h: bytes, tier: str, parent: bytes) -> MirroredPage:
        """What the contents listing says, with the tokens (and parent) we knew already."""
        old = self.tiers[tier].get(h)
        if old is None:
            return MirroredPage(parent, b"")
        return MirroredPage(parent or old.parent, old.tokens)

    def snapshot(self) -> list[TierEvent]:
        """Every page held, one event each (a replay)."""
        return [self._stored(t, h, p) for t in STORAGE_TIERS for h, p in self.tiers[t].items()]

    @staticmethod
    def _stored(tier: str, h: bytes, page: MirroredPage) -> BlockStored:
        return BlockStored(tier, (h,), page.parent or None, page.token_ids())
