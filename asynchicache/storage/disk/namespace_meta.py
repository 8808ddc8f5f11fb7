"""`<root>/ns-<id>/namespace.json`: what a namespace folder holds, for tools without a model.

The folder's name is a hash of the namespace; the file keeps the namespace's
bytes and its page layout, so offline tools (`asynchicache cache clear
--remote-url`) can name the namespace's Redis keys and apply a cache_salt even
when no page file is left. Written once, atomically, by the first service
that opens the folder.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from asynchicache.common.fileio import write_private_text
from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.page_file import read_header

META_NAME = "namespace.json"


@dataclass(frozen=True)
class FolderNamespace:
    """What a namespace folder holds: its namespace bytes and layout (None: unknown)."""

    folder: Path
    namespace: bytes = b""
    layout: PageLayout | None = None


def write_meta(folder: Path, namespace: bytes, layout: PageLayout) -> None:
    path = folder / META_NAME
    if path.exists():
        return
    meta = {"namespace": namespace.hex(), "dtype": layout.dtype, "shape": list(layout.shape)}
    write_private_text(path, json.dumps(meta))


def read_namespace(folder: Path) -> FolderNamespace:
    """From `namespace.json`, else from the first page header that parses."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        meta = json.loads((folder / META_NAME).read_text())
        layout = PageLayout(str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
        return FolderNamespace(folder, bytes.fromhex(meta["namespace"]), layout)
    for path in sorted(folder.glob("??/*.kv")):
        header = read_header(path)
        if not isinstance(header, str):
            return FolderNamespace(folder, header.namespace, header.layout)
    return FolderNamespace(folder)
