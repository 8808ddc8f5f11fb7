"""Which stored pages descend from a chain root: how a `cache_salt`'s pages are told apart.

A tenant's `cache_salt` is part of its namespace's digest, so its chains start
from their own root, h_0 = `Namespace.with_salt(salt).digest()`, yet its pages
live in the same folder (and under the same Redis key prefix) as everyone
else's of that model. Every stored page names its parent (page header format
2), so the pages of one root are the descendants of that root in the graph of
parent links, found without knowing any token.

A page whose parent link is broken (its prefix was evicted first, or it was
written without a parent) cannot be attributed and is left alone by a clear of
one root; such a page can never be hit (a lookup needs its whole prefix), and
LRU eviction takes it in time. A clear of the whole namespace removes it.
"""

from __future__ import annotations

from collections.abc import Mapping


def descendants(parents: Mapping[bytes, bytes], root: bytes) -> set[bytes]:
    """The pages of `parents` (page -> parent hash) whose parent chain reaches `root`."""
    children: dict[bytes, list[bytes]] = {}
    for page, parent in parents.items():
        if parent:
            children.setdefault(parent, []).append(page)
    found: set[bytes] = set()
    todo = list(children.get(root, ()))
    while todo:
        page = todo.pop()
        if page not in found:
            found.add(page)
            todo.extend(children.get(page, ()))
    return found
