"""Pages another service wrote into a shared folder: found by name, checked before use.

A page's file name is its hash, so when the index lacks a chain's page the
folder is asked directly. `adopt` costs one `stat` per page (the file must
have a page file's size): it runs on the service's loop thread, inside the
engine's short `exists` budget, and the files are often not in the page cache
(written with O_DIRECT by the other service), so no header is read there.
An adopted page is "unverified": before its first read lets any byte into an
L2 slot, `verify` checks its header (namespace, hash, layout, size), so a
planted file of another namespace never reaches the pool; the read then
verifies the payload as every read does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from asynchicache.storage.disk.page_file import FileInfo, PageFiles
from asynchicache.storage.page_index import IndexedPage, PageIndex

Discard = Callable[[bytes, Path, str], None]


class FolderAdoption:
    def __init__(
        self,
        files: PageFiles,
        index: PageIndex,
        path_of: Callable[[bytes], Path],
        file_bytes: int,
        count: Callable[..., None],
    ) -> None:
        self._files = files
        self._index = index
        self._path_of = path_of
        self._file_bytes = file_bytes
        self._count = count
        self._unverified: set[bytes] = set()
        self._lock = threading.Lock()

    def adopt(self, hashes: Sequence[bytes], parent: bytes = b"") -> int:
        """Index the leading pages of `hashes` whose files are in the folder; how many.
        `parent` is the first page's parent when known (the rest chain from it)."""
        found = []
        for h in hashes:
            try:
                size = os.stat(self._path_of(h)).st_size
            except OSError:
                break
            if size != self._file_bytes:
                self._count(adopt_rejected=1)
                break
            found.append(IndexedPage(h, size, parent))
            parent = h
        if found:
            with self._lock:
                self._unverified.update(p.page_hash for p in found)
                if len(self._unverified) > 2 * len(self._index) + 1024:  # evicted unread
                    self._unverified = {h for h in self._unverified if h in self._index}
            self._index.add_chain(found)
            self._count(adopted=len(found))
        return len(found)

    def verify(self, page_hash: bytes, discard: Discard) -> bool:
        """Whether a page may be read into a slot: checked already, or its header is sound
        now (a bad file is discarded, a vanished one leaves the index)."""
        with self._lock:
            if page_hash not in self._unverified:
                return True
        path = self._path_of(page_hash)
        info = self._files.check(path, page_hash)
        if isinstance(info, str):
            discard(page_hash, path, info)
        elif info is None and self._index.remove(page_hash) is not None:
            self._count(vanished=1)
        if not isinstance(info, FileInfo):
            return False
        self.verified(page_hash)
        return True

    def verified(self, page_hash: bytes) -> None:
        """The page's header was checked (read, or found bad and removed)."""
        with self._lock:
            self._unverified.discard(page_hash)
