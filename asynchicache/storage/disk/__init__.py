"""storage.disk: L3, page files in a folder on a local disk.

backend.py is the tier (`DiskBackend`, one namespace's files); config.py its settings;
write.py / page_file.py / names.py how a page becomes a file and is named; space.py,
folder.py, folder_ledger.py the folder's budget shared by every namespace and server on
it; scan.py / adopt.py what a start finds there; pins.py the pins kept beside the pages;
clear.py and admin.py clears, listings and checks; namespace_meta.py what a namespace
folder says it holds.

Names load on first use (PEP 562): importing one module of the package does not load
the others.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_MODULE_OF = MappingProxyType(
    {
        "DiskBackend": "backend",
        "DiskConfig": "config",
        "PageWriter": "write",
        "Pin": "pins",
        "PinLimitError": "pins",
        "PinStore": "pins",
        "check_disk_folder": "folder",
        "folder_stats": "admin",
        "verify_folder": "admin",
    }
)

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
