"""Which page files of a namespace folder a clear removes (the service's and the CLI's).

Every page file of the folder counts, indexed by this process or not (another
service on the same folder may have written it). With a `ClearScope.root`
only the descendants of that root go (storage.lineage): parents come from the
caller's index where it knows them, else from the file's header. Pinned pages
stay unless the scope includes them. Temp files are left to their writers (a
live writer on a shared folder still renames its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from pathlib import Path

from asynchicache.storage.base import ClearScope
from asynchicache.storage.disk.disk_pins import PinStore
from asynchicache.storage.disk.names import page_subdirs, parse_page_file_name, scandir
from asynchicache.storage.disk.page_file import read_header
from asynchicache.storage.header import PageHeader
from asynchicache.storage.lineage import descendants


@dataclass(frozen=True)
class ClearPlan:
    targets: tuple[tuple[bytes, Path], ...]  # (page hash, file) to remove
    pinned_kept: int


def namespace_pages(folder: Path) -> dict[bytes, Path]:
    """Every page file of a namespace folder, by page hash."""
    pages = {}
    for sub in page_subdirs(folder):
        for entry in scandir(sub):
            page_hash = parse_page_file_name(entry.name)
            if page_hash is not None:
                pages[page_hash] = Path(entry.path)
    return pages


def plan_clear(
    folder: Path,
    scope: ClearScope,
    pinned: Set[bytes],
    known_parents: Mapping[bytes, bytes] | None = None,
) -> ClearPlan:
    """The files a clear of `scope` removes, and how many pinned pages it keeps."""
    files = namespace_pages(folder)
    chosen = set(files)
    if scope.root:
        parents = {h: p for h, p in (known_parents or {}).items() if p}  # b"": not known
        for page_hash, path in files.items():
            if page_hash not in parents:
                header = read_header(path)  # a damaged file has no parent: not attributed
                parents[page_hash] = header.parent if isinstance(header, PageHeader) else b""
        chosen &= descendants(parents, scope.root)
    kept = set() if scope.include_pinned else chosen & pinned
    targets = tuple(sorted((h, files[h]) for h in chosen - kept))
    return ClearPlan(targets, len(kept))


def drop_pins(pins: PinStore, scope: ClearScope) -> int:
    """With `include_pinned`, remove the pins the scope covers; how many."""
    if not scope.include_pinned:
        return 0
    doomed = [p.pin_id for p in pins.active() if not scope.root or p.root == scope.root]
    return pins.remove(doomed)
