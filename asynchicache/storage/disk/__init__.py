"""storage.disk: L3, page files in a folder on a local disk.

backend.py is the tier (`DiskBackend`, one namespace's files); config.py its settings;
write.py / page_file.py / names.py how a page becomes a file and is named; space.py,
folder.py, folder_ledger.py the folder's budget shared by every namespace and server on
it; scan.py / adopt.py what a start finds there; pins.py the pins kept beside the pages;
clear.py and admin.py clears, listings and checks; namespace_meta.py what a namespace
folder says it holds.

Names load on first use (asynchicache.faces).
"""

from __future__ import annotations

from asynchicache.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
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
    },
)
