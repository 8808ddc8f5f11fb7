"""What our tiers store and drop, as vLLM KV cache events (`--kv-events-config`).

vLLM publishes its own block events (medium GPU) and, each step, those its
KV connector hands over (`take_events`). Ours, so that a router following
vLLM's event stream (vllm-router, llm-d, Dynamo) learns what our tiers hold, in the
media of kv_events/wire.py:

    BlockStored  medium CPU   pages published in this instance's L2 (saved or loaded)
    BlockRemoved medium CPU   pages evicted from L2
    BlockStored  medium DISK  pages the cache service stored (disk, and Redis: the
                              connector is not told which; routers price it as disk)
                              with `ownership` = the fleet's pool when that storage is
                              shared (ConnectorConfig.storage_ownership: serve's
                              --kv-events-shared-disk, or an L4 the service writes to)

A page is one "block" of `page_size` tokens named, as vLLM names its own, by an int:
the low 64 bits of our chained page hash (`parent_block_hash` is the previous page's;
None for a chain's first page), with its token ids. Pages the service later evicts
from disk are not reported: the service does not tell the connector (a consumer ages
DISK entries out, or looks them up). Events are kept only while vLLM publishes them,
so nothing piles up unread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from asynchicache.common.tiers import Tier
from asynchicache.kv_events.wire import MEDIUM, external_hash
from asynchicache.storage.base import PageRef

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent

MEDIUM_CPU = MEDIUM[Tier.HOST]
MEDIUM_STORAGE = MEDIUM[Tier.DISK]

__all__ = ["MEDIUM_CPU", "MEDIUM_STORAGE", "KVEventLog", "events_enabled"]


def events_enabled(vllm_config: VllmConfig) -> bool:
    config = vllm_config.kv_events_config
    return bool(config is not None and config.enable_kv_cache_events)


class KVEventLog:
    """Events since vLLM last took them (nothing is kept when `enabled` is false).
    `storage_ownership`: the `ownership` of medium DISK pages (None: this instance's)."""

    def __init__(self, enabled: bool, page_size: int, storage_ownership: str | None = None) -> None:
        self.enabled = enabled
        self.page_size = page_size
        self.storage_ownership = storage_ownership
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        pages: Sequence[PageRef],
        medium: str,
        root: bytes | None = None,
        lora_name: str | None = None,
    ) -> None:
        """`pages` (each with its tokens and parent) now live in `medium`; one event per
        run of pages that chain on each other. A page whose parent is `root` (its
        chain's namespace digest) is a first page: no parent block."""
        if not self.enabled or not pages:
            return
        run: list[PageRef] = []
        for page in pages:
            if run and page.parent != run[-1].page_hash:
                self._stored_run(run, medium, root, lora_name)
                run = []
            run.append(page)
        self._stored_run(run, medium, root, lora_name)

    def _stored_run(
        self, run: list[PageRef], medium: str, root: bytes | None, lora_name: str | None
    ) -> None:
        parent = run[0].parent
        self._events.append(
            BlockStored(
                block_hashes=[external_hash(p.page_hash) for p in run],
                parent_block_hash=None if not parent or parent == root else external_hash(parent),
                token_ids=[t for p in run for t in p.tokens],
                block_size=self.page_size,
                lora_id=None,
                medium=medium,
                lora_name=lora_name,
                ownership=self.storage_ownership if medium == MEDIUM_STORAGE else None,
            )
        )

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        if self.enabled and hashes:
            self._events.append(
                BlockRemoved(block_hashes=[external_hash(h) for h in hashes], medium=medium)
            )

    def take(self) -> list[KVCacheEvent]:
        out, self._events = self._events, []
        return out
