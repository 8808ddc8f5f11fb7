"""The start-up scan of a namespace folder: its index rebuilt from the page headers.

Headers only (payloads are verified when read). A file that is not sound is
removed through the backend's `discard` (counted, its bytes given back to the
folder's ledger); temp files older than `STALE_TMP_S` belong to writers that
died and are removed; anything else is not ours and is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from asynchicache.storage.disk.names import (
    TMP_PREFIX,
    page_subdirs,
    parse_page_file_name,
    scandir,
)
from asynchicache.storage.disk.page_file import PageFiles
from asynchicache.storage.page_index import IndexedPage, PageIndex

log = logging.getLogger(__name__)

# A temp file this old belongs to a writer that died (a live one renames in ms).
STALE_TMP_S = 600.0

Discard = Callable[[bytes, Path, str], None]


def scan_folder(
    folder: Path, files: PageFiles, index: PageIndex, discard: Discard, stop: threading.Event
) -> bool:
    """Index every sound page file of `folder`; False when `stop` cut it short."""
    index.begin_scan()
    for sub in page_subdirs(folder):
        if stop.is_set():
            index.end_scan()
            return False
        index.add_scanned(_scan_subdir(sub, files, discard))
    index.end_scan()
    return True


def _scan_subdir(sub: Path, files: PageFiles, discard: Discard) -> list[IndexedPage]:
    found = []
    for entry in scandir(sub):
        path = Path(entry.path)
        if entry.name.startswith(TMP_PREFIX):
            _remove_if_stale(path)
            continue
        page_hash = parse_page_file_name(entry.name)
        if page_hash is None:
            continue  # not ours: leave it alone
        info = files.check(path, page_hash)
        if isinstance(info, str):
            discard(page_hash, path, info)
        elif info is not None:
            found.append(IndexedPage(page_hash, info.size, info.parent, info.tokens, info.stamp_ns))
    return found


def _remove_if_stale(path: Path) -> None:
    try:
        if time.time() - path.stat().st_mtime > STALE_TMP_S:
            path.unlink()
            log.info("removed stale temp file %s", path)
    except FileNotFoundError:
        pass
