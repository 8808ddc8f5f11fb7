"""`lookup`: how many tokens of a prompt each tier holds, without touching LRU or the tree.

The tiers are named as `usage.prompt_tokens_details.cached_tokens_by_tier` names
them: `device` (L1) and `host` (L2) from the tree, then `disk` (L3) and `remote`
(L4) for the pages after the tree's part, as the cache service counts them (a
storage tier that cannot tell its parts apart reports all of them as disk).
"""

from __future__ import annotations

import logging

from asynchicache.cache.keys import chain_hashes
from asynchicache.cache.radix import RadixNode, RadixTree
from asynchicache.storage.base import StorageTier, TierLookup

log = logging.getLogger(__name__)

TIER_NAMES = ("device", "host", "disk", "remote")


def lookup(
    tree: RadixTree, root: RadixNode, tokens: list[int], storage: StorageTier | None
) -> dict[str, int]:
    """Cached tokens of `tokens` per tier, from `root` (a cache_salt's tree)."""
    ps = tree.page_size
    walk = tree.walk(tokens, root=root)
    counts = dict.fromkeys(TIER_NAMES, 0)
    pairs = [(n, n.num_pages) for n in walk.path]
    if walk.partial is not None:
        pairs.append((walk.partial, walk.partial_pages))
    for node, k in pairs:
        counts["device" if node.device is not None else "host"] += k * ps
    if storage is None:
        return counts
    node, k = pairs[-1] if pairs else (root, 0)
    end = node.start_page + k if pairs else 0
    last = node.hashes[k - 1] if k else tree.last_hash(root)
    rest = tokens[end * ps : (len(tokens) // ps) * ps]
    if rest:
        disk, remote = _stored(storage, chain_hashes(last, rest, ps))
        counts["disk"], counts["remote"] = disk * ps, remote * ps
    return counts


def _stored(storage: StorageTier, hashes: list[bytes]) -> tuple[int, int]:
    try:
        if isinstance(storage, TierLookup):
            return storage.exists_by_tier(hashes)
        return storage.exists(hashes), 0
    except Exception:
        log.exception("storage.exists failed during lookup")
        return 0, 0
