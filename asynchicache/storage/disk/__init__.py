"""storage.disk: L3, page files in a folder on a local disk.

disk_backend.py is the tier (`DiskBackend`, one namespace's files); disk_config.py its
settings; write.py / page_file.py / names.py how a page becomes a file and is named;
space.py, folder.py, folder_ledger.py the folder's budget shared by every namespace and
server on it; scan.py / adopt.py what a start finds there; disk_pins.py the pins kept
beside the pages; clear.py and disk_admin.py clears, listings and checks;
namespace_meta.py what a namespace folder says it holds.

Names load on first use (asynchicache.common.faces).
"""

from __future__ import annotations

from asynchicache.common.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
    {
        "DiskBackend": "disk_backend",
        "DiskConfig": "disk_config",
        "PageWriter": "write",
        "PinLimitError": "disk_pins",
        "PinStore": "disk_pins",
        "check_disk_folder": "folder",
        "folder_stats": "disk_admin",
        "verify_folder": "disk_admin",
    },
)
