"""What the tiers hold of a prompt, read without touching LRU or splitting a node.

`lookup` counts it per tier, `l1_pages` and `locked_l1_pages` how much of its
L1 part there is and a lock protects, `stored_after` which pages after the
tree's part storage holds.

The tiers are named as `usage.prompt_tokens_details.cached_tokens_by_tier` names
them: `device` (L1) and `host` (L2) from the tree, then `disk` (L3) and `remote`
(L4) for the pages after the tree's part, as the cache service counts them (a
storage tier that cannot tell its parts apart reports all of them as disk).
"""

from __future__ import annotations

import logging

from asynchicache.common.keys import chain_hashes
from asynchicache.common.tiers import TIERS
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.radix import RadixTree
from asynchicache.storage.base import StorageTier, TierLookup

log = logging.getLogger(__name__)


def lookup(
    tree: RadixTree, root: RadixNode, tokens: list[int], storage: StorageTier | None
) -> dict[str, int]:
    """Cached tokens of `tokens` per tier, from `root` (a cache_salt's tree)."""
    ps = tree.page_size
    walk = tree.walk(tokens, root=root)
    counts = dict.fromkeys(TIERS, 0)
    pairs = walk.runs
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


def l1_pages(tree: RadixTree, root: RadixNode, tokens: list[int]) -> int:
    """Leading L1 pages of `tokens` from `root`."""
    pages = 0
    for node, k in tree.walk(tokens, root=root).runs:
        if node.device is None:
            break  # L1 is prefix-closed
        pages += k
    return pages


def locked_l1_pages(tree: RadixTree, root: RadixNode, tokens: list[int]) -> int:
    """Leading L1 pages of `tokens` from `root` that some lock already protects."""
    pages = 0
    for node, k in tree.walk(tokens, root=root).runs:
        if node.device is None or not node.lock_ref:
            break  # L1 is prefix-closed; locks count along the path
        pages += k
    return pages


def stored_after(
    tree: RadixTree, storage: StorageTier, node: RadixNode, tokens: list[int], limit: int
) -> tuple[bytes, ...]:
    """Hashes of the leading pages after `node` (up to page `limit`) that storage holds."""
    ps = tree.page_size
    hashes = chain_hashes(tree.last_hash(node), tokens[node.end_page * ps : limit * ps], ps)
    found = _stored(storage, hashes, by_tier=False)[0]
    return tuple(hashes[: max(0, min(found, len(hashes)))])


def _stored(storage: StorageTier, hashes: list[bytes], by_tier: bool = True) -> tuple[int, int]:
    """Leading pages of `hashes` storage holds (disk, remote); a failing storage holds none."""
    try:
        if by_tier and isinstance(storage, TierLookup):
            return storage.exists_by_tier(hashes)
        return storage.exists(hashes), 0
    except Exception:
        log.exception("storage.exists failed; treating as a miss")
        return 0, 0
