"""`asynchicache cache clear`: the disk folder and the remote tier, with no service running.

    asynchicache cache clear --disk-cache-dir DIR [--remote-url URL] [--namespace ns-...]
                             [--cache-salt SALT] [--include-pinned] [--all-remote-namespaces]

What a namespace's pages are is known from the folder: each `ns-*` folder's
`namespace.json` (written by the service; a page header when it is missing)
names its namespace bytes and page layout, hence its remote key prefix. A clear
removes the selected namespaces' page files (storage.disk.clear: pinned pages
stay unless `include_pinned`) and, with a remote URL, their values in Redis or
Valkey (storage.remote.admin: SCAN + UNLINK in batches, other keys untouched).
`--all-remote-namespaces` clears every `ackv:` key, for namespaces the folder
no longer knows. A namespace folder left with nothing in it is removed.

A namespace a live server (or vLLM's cache service) leases is refused, and
nothing at all is removed, unless `force`: its pages would vanish under the
running server (it stays correct, each a counted miss, but a clear is the
server's own job there: `POST /cache/clear`). With `force` the folder's usage
ledger is updated here as the server's would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asynchicache.storage.base import Cleared, ClearScope
from asynchicache.storage.disk.clear import drop_pins, plan_clear
from asynchicache.storage.disk.disk_pins import PINS_DIR, PinStore
from asynchicache.storage.disk.folder import LEASE_NAME, exclusive, in_use
from asynchicache.storage.disk.folder_ledger import FolderLedger
from asynchicache.storage.disk.names import namespace_folders, unlink_size
from asynchicache.storage.disk.namespace_meta import META_NAME, FolderNamespace, read_namespace
from asynchicache.storage.remote.remote_admin import clear_prefix
from asynchicache.storage.remote.remote_config import remote_key_prefix
from asynchicache.storage.remote.topology import admin_client, parse_remote_url

ALL_REMOTE_PREFIX = b"ackv:"

RootOf = Callable[[bytes], bytes]  # namespace bytes -> the chain root to clear


@dataclass(frozen=True)
class ClearRequest:
    root: Path
    remote_url: str | None = None
    namespaces: tuple[str, ...] = ()  # ns-* folder names; empty: every one
    include_pinned: bool = False
    all_remote: bool = False
    root_of: RootOf | None = None  # a cache_salt's chain root, per namespace
    force: bool = False  # clear namespaces a live server leases too

    def scope(self, namespace: bytes) -> ClearScope | None:
        """What to clear of `namespace`; None: nothing (a salt cannot apply to it: another
        engine's or version's namespace holds no chain of that salt)."""
        if self.root_of is None:
            return ClearScope(b"", self.include_pinned)
        try:
            return ClearScope(self.root_of(namespace), self.include_pinned)
        except ValueError:
            return None


@dataclass
class ClearReport:
    disk: dict[str, Cleared] = field(default_factory=dict)
    remote: dict[str, Cleared] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        def total(part: dict[str, Cleared]) -> dict[str, Any]:
            return {
                "removed": sum(c.removed for c in part.values()),
                "pinned_kept": sum(c.pinned_kept for c in part.values()),
                "errors": [f"{ns}: {c.error}" for ns, c in part.items() if c.error],
                "namespaces": {ns: c.removed for ns, c in part.items()},
            }

        disk, remote = total(self.disk), total(self.remote)
        return {"removed": disk["removed"] + remote["removed"], "disk": disk, "remote": remote}


class FolderInUseError(ValueError):
    """A namespace to clear is leased by a live server (and the clear was not forced)."""


def clear_offline(req: ClearRequest) -> ClearReport:
    report = ClearReport()
    folders = _selected(req)
    live = [ns.folder.name for ns in folders if in_use(ns.folder)]
    if live and not req.force:
        raise FolderInUseError(
            f"a running server uses {', '.join(live)} in {req.root}: nothing removed. Clear "
            "it through that server (POST /cache/clear), stop it first, or pass --force"
        )
    for ns in folders:
        report.disk[ns.folder.name] = _clear_disk(req, ns)
    if req.remote_url:
        _clear_remote(req, folders, report)
    return report


def _selected(req: ClearRequest) -> list[FolderNamespace]:
    found = {f.name: f for f in namespace_folders(req.root)}
    unknown = sorted(set(req.namespaces) - set(found))
    if unknown:
        raise ValueError(f"--namespace {', '.join(unknown)}: no such folder in {req.root}")
    names = req.namespaces or tuple(sorted(found))
    return [read_namespace(found[n]) for n in names]


def _clear_disk(req: ClearRequest, ns: FolderNamespace) -> Cleared:
    if req.root_of is not None and not ns.namespace:
        return Cleared(error="namespace unknown (no namespace.json, no page): salt not applied")
    scope = req.scope(ns.namespace)
    if scope is None:
        return Cleared()
    pins = PinStore(ns.folder)
    plan = plan_clear(ns.folder, scope, pins.hashes())
    freed = [unlink_size(path) for _, path in plan.targets]
    ledger = FolderLedger(req.root)
    try:
        ledger.release(sum(freed))
    finally:
        ledger.close()
    drop_pins(pins, scope)
    _remove_if_empty(ns.folder)
    return Cleared(sum(f > 0 for f in freed), plan.pinned_kept)


def _clear_remote(
    req: ClearRequest, folders: Sequence[FolderNamespace], report: ClearReport
) -> None:
    assert req.remote_url is not None
    client = admin_client(parse_remote_url(req.remote_url))
    try:
        if req.all_remote:  # pins of the namespaces the folder knows still hold
            every = {h for ns in folders for h in PinStore(ns.folder).hashes()}
            anyone = ClearScope(include_pinned=req.include_pinned)
            report.remote["ackv:*"] = clear_prefix(client, ALL_REMOTE_PREFIX, anyone, every)
            return
        for ns in folders:
            if ns.layout is None:
                report.remote[ns.folder.name] = Cleared(error="namespace unknown: keys not named")
                continue
            scope = req.scope(ns.namespace)
            if scope is None:
                report.remote[ns.folder.name] = Cleared()
                continue
            pinned = PinStore(ns.folder).hashes()
            prefix = remote_key_prefix(ns.namespace, ns.layout)
            report.remote[ns.folder.name] = clear_prefix(client, prefix, scope, pinned)
    finally:
        client.close()


def _remove_if_empty(folder: Path) -> None:
    """A namespace folder with no page and no pin left goes (unless a live server leases it)."""
    if any(folder.glob("??/*")) or any((folder / PINS_DIR).glob("*.pin")):
        return
    with exclusive(folder, create=False) as unused:
        if not unused:
            return
        for name in (LEASE_NAME, META_NAME):
            (folder / name).unlink(missing_ok=True)
        for sub in [*folder.glob("??"), folder / PINS_DIR]:
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            folder.rmdir()
