"""Names in a disk cache folder: what every process computes alike, so they can share it.

    <root>/ns-<namespace id>/<first 2 hex of hash>/<32 hex of hash>.kv   a page
    <root>/ns-<namespace id>/.tmp-*                                      a write in progress
    <root>/ns-<namespace id>/pins/<32 hex>.pin                           a pin (storage.disk.pins)
    <root>/ns-<namespace id>/namespace.json                              what the folder holds
    <root>/.lock, <root>/.usage                                          storage.disk.folder_ledger

A page's file name is its chained hash, so any process that knows a chain
knows where its pages are (an index miss can look there: storage.disk.backend).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import xxhash

PAGE_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
NS_PREFIX = "ns-"


def namespace_dir_name(namespace: bytes) -> str:
    """The folder of one namespace: derived from its bytes, stable across processes."""
    return NS_PREFIX + xxhash.xxh3_64_hexdigest(b"asynchicache-ns-dir\x00" + namespace)


def page_file_name(page_hash: bytes) -> str:
    return page_hash.hex() + PAGE_SUFFIX


def page_path(folder: Path, page_hash: bytes) -> Path:
    """Where a page of the namespace folder `folder` lives."""
    name = page_file_name(page_hash)
    return folder / name[:2] / name


def parse_page_file_name(name: str) -> bytes | None:
    """The page hash a file name stands for, or None when it is not a page file."""
    stem = name[: -len(PAGE_SUFFIX)] if name.endswith(PAGE_SUFFIX) else ""
    if len(stem) != 32:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def scandir(folder: Path) -> list[os.DirEntry[str]]:
    """A folder's entries; none when it is gone (removed meanwhile by a clear or an evictor)."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def page_subdirs(folder: Path) -> list[Path]:
    """The `xx/` folders of a namespace folder, sorted."""
    return sorted(Path(e.path) for e in scandir(folder) if len(e.name) == 2 and e.is_dir())


def namespace_folders(root: Path) -> list[Path]:
    return sorted(
        Path(e.path) for e in scandir(root) if e.name.startswith(NS_PREFIX) and e.is_dir()
    )


def file_size(path: Path) -> int:
    """A file's size; 0 when it is gone."""
    with contextlib.suppress(FileNotFoundError):
        return path.stat().st_size
    return 0


def unlink_size(path: Path, size: int | None = None) -> int:
    """Remove a file; the bytes this freed (0 when someone else removed it first).

    Exactly one of several processes removing the same file gets its size back,
    so the folder's usage ledger is decremented once (storage.disk.folder_ledger).
    """
    if size is None:
        size = file_size(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return 0
    return size
