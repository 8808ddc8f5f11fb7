"""Namespace administration of the remote tier: list and clear one namespace's values.

Never `KEYS` (it blocks the server for the whole keyspace) and never
`FLUSHDB`/`FLUSHALL` (other namespaces and other applications share the
database): `SCAN MATCH <prefix>*` in batches (redis-py walks every primary of
a cluster), and `UNLINK` (freed by the server in the background) in pipelined
batches of `batch` keys. Only keys under the namespace's prefix are touched.

A clear of one chain root (a `cache_salt`'s pages: storage.lineage) first
reads every value's header with `GETRANGE key 0 4095` (pipelined; 4 KiB per
page, not the page), builds the parent links, and unlinks the root's
descendants. Pinned pages are skipped unless the scope includes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any

from asynchicache.storage.base import Cleared, ClearScope
from asynchicache.storage.header import HEADER_ALIGN, HeaderError, decode_header, peek_header_len
from asynchicache.storage.lineage import descendants

BATCH = 500

Removed = Callable[[Sequence[bytes]], None]


def page_of(key: bytes, prefix: bytes) -> bytes | None:
    """The page hash a key under `prefix` stands for (None: not one of ours). Keys are
    `ackv:<namespace id>:<page hash hex>`, so this works for the bare `ackv:` too."""
    if not key.startswith(prefix):
        return None
    try:
        page = bytes.fromhex(key.rsplit(b":", 1)[-1].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return page if len(page) == 16 else None


def scan_batches(client: Any, prefix: bytes, batch: int = BATCH) -> Iterator[list[bytes]]:
    """The keys under `prefix`, `batch` at a time (SCAN: never blocks the server)."""
    keys: list[bytes] = []
    for key in client.scan_iter(match=prefix + b"*", count=batch):
        keys.append(key)
        if len(keys) >= batch:
            yield keys
            keys = []
    if keys:
        yield keys


def read_parents(client: Any, keys: Sequence[bytes]) -> dict[bytes, bytes]:
    """Each key's parent hash from its value's header (b"" when unreadable or unknown)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.getrange(key, 0, HEADER_ALIGN - 1)
    heads = pipe.execute()
    parents = {}
    for key, head in zip(keys, heads, strict=True):
        parents[key] = _parent(client, key, head or b"")
    return parents


def _parent(client: Any, key: bytes, head: bytes) -> bytes:
    try:
        header_len = peek_header_len(head)
        if header_len > len(head):
            head = client.getrange(key, 0, header_len - 1) or b""
        return decode_header(head).parent
    except HeaderError:
        return b""


def clear_prefix(
    client: Any,
    prefix: bytes,
    scope: ClearScope,
    pinned: Set[bytes],
    on_removed: Removed | None = None,
) -> Cleared:
    """Remove the values of one namespace (`prefix`) in `scope`; see the module docstring."""
    if scope.root:
        return _clear_root(client, prefix, scope, pinned, on_removed)
    removed = kept = 0
    for keys in scan_batches(client, prefix):
        doomed, spared = _split(keys, prefix, pinned, scope.include_pinned)
        kept += spared
        removed += _unlink_reported(client, doomed, prefix, on_removed)
    return Cleared(removed, kept)


def _clear_root(
    client: Any, prefix: bytes, scope: ClearScope, pinned: Set[bytes], on_removed: Removed | None
) -> Cleared:
    parents: dict[bytes, bytes] = {}
    for keys in scan_batches(client, prefix):
        for key, parent in read_parents(client, keys).items():
            page = page_of(key, prefix)
            if page is not None:
                parents[page] = parent
    chosen = descendants(parents, scope.root)
    keys = [prefix + page.hex().encode() for page in sorted(chosen)]
    doomed, kept = _split(keys, prefix, pinned, scope.include_pinned)
    return Cleared(_unlink_reported(client, doomed, prefix, on_removed), kept)


def _split(
    keys: Sequence[bytes], prefix: bytes, pinned: Set[bytes], include_pinned: bool
) -> tuple[list[bytes], int]:
    """(keys to remove, how many pinned ones are kept)."""
    if include_pinned or not pinned:
        return list(keys), 0
    doomed = [k for k in keys if page_of(k, prefix) not in pinned]
    return doomed, len(keys) - len(doomed)


def _unlink_reported(
    client: Any, keys: Sequence[bytes], prefix: bytes, on_removed: Removed | None
) -> int:
    removed = 0
    for k in range(0, len(keys), BATCH):
        part = keys[k : k + BATCH]
        pipe = client.pipeline(transaction=False)
        for key in part:
            pipe.unlink(key)
        gone = [key for key, n in zip(part, pipe.execute(), strict=True) if int(n)]
        removed += len(gone)
        if on_removed is not None and gone:
            on_removed([p for p in (page_of(key, prefix) for key in gone) if p is not None])
    return removed


def list_pages(client: Any, prefix: bytes) -> list[bytes]:
    """Every page hash stored under `prefix` (SCAN)."""
    pages = []
    for keys in scan_batches(client, prefix):
        pages += [p for p in (page_of(k, prefix) for k in keys) if p is not None]
    return pages
