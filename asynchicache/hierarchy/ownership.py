"""Which L1 pages a caller may hand to the cache, checked against the page ledger.

`free` takes back only pages private to a request; `insert` takes pages private
to the caller, or the tree's own pages at those very positions (a request that
inserts a prefix it matched). Anything else is a caller's bug, refused with an
error that names the page, before any state changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from asynchicache.hierarchy.l2.ledger import PageState, PoolLedger
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.radix import RadixTree


def _not_private(ledger: PoolLedger, pages: Sequence[int]) -> list[int]:
    """Positions in `pages` of pages that are not PRIVATE (or not pages at all)."""
    return [
        i for i, p in enumerate(pages)
        if not 0 <= p < ledger.size or ledger.state(p) != PageState.PRIVATE
    ]  # fmt: skip


def check_freeable(ledger: PoolLedger, pages: Sequence[int]) -> None:
    """Raise unless every page of `pages` is private to a request, once."""
    stray = [pages[i] for i in _not_private(ledger, pages)]
    if stray or len(set(pages)) != len(pages):
        raise ValueError(f"pages {stray or list(pages)} are not private to a request "
                         "(tree-owned, free or repeated)")  # fmt: skip


def check_insertable(
    tree: RadixTree, ledger: PoolLedger, tokens: list[int], full: list[int], root: RadixNode
) -> None:
    """Raise unless page i of `full` is private to the caller or the tree's page i of `tokens`."""
    if len(set(full)) != len(full):
        raise ValueError("the same device page appears twice in one insert")
    foreign = _not_private(ledger, full)
    if not foreign:
        return
    tree_pages: list[int] = []
    for node, k in tree.walk(tokens, foreign[-1] + 1, root).runs:
        tree_pages += (node.device or [-1] * node.num_pages)[:k]
    for i in foreign:
        if i >= len(tree_pages) or tree_pages[i] != full[i]:
            raise ValueError(
                f"device page {full[i]} at page {i} is neither private to the caller "
                f"nor the tree's page for those tokens"
            )
