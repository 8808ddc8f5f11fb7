"""Pins: chains of pages kept from eviction, stored as small files in the disk folder.

    <root>/ns-<id>/pins/<32 hex of the chain's last page hash>.pin    (JSON)

A pin names its chain's page hashes, the chain's root (h_0: the namespace's
digest, or a `cache_salt`'s), its owner (a keyed fingerprint of the salt,
storage.tenant_key: a pin file never holds a salt), the size of one page file
(for the cap), and its expiry as wall-clock time (so it means the same after a
restart and to every process). Being files in the folder, pins survive
restarts and bind every service using the folder: each reloads a namespace's
pins before it evicts (when the `pins/` folder changed, or a pin expired).

A chain's last hash names the whole chain (and its root), so pinning the
same prefix again replaces its pin (a new TTL); a longer prefix is a pin of
its own. A pin may name pages not stored yet: they are kept once stored.

The share of the folder pins may take (`--max-pinned-fraction` of
`--disk-cache-gb`) counts every namespace's unexpired pins, each distinct
page once; `PinLimitError` says by how much a pin would exceed it. Pins are
written under the folder's ledger lock, so two services cannot both take the
last room.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from asynchicache.common.fileio import make_private_dir, write_private_text
from asynchicache.storage.admin_messages import Pin
from asynchicache.storage.disk.names import namespace_folders, scandir

log = logging.getLogger(__name__)

PINS_DIR = "pins"
PIN_SUFFIX = ".pin"
_VERSION = 1
# A folder whose mtime has a coarse resolution may hide a change: reload this often anyway.
_RELOAD_S = 5.0


class PinLimitError(ValueError):
    """A pin would take more than `--max-pinned-fraction` of the tier (HTTP: 409)."""

    def __init__(self, message: str, would_pin: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.would_pin = would_pin
        self.limit_bytes = limit_bytes


def pin_json(pin: Pin) -> str:
    """A pin file's text."""
    return json.dumps(
        {
            "version": _VERSION,
            "pin_id": pin.pin_id,
            "root": pin.root.hex(),
            "owner": pin.owner,
            "pages": [h.hex() for h in pin.pages],
            "page_file_bytes": pin.page_file_bytes,
            "created_at": pin.created_at,
            "expires_at": pin.expires_at,
        }
    )


def pin_from_json(text: str) -> Pin:
    """The pin of a pin file's text; ValueError on anything that is not a pin file of
    this version."""
    try:
        d = json.loads(text)
        if d["version"] != _VERSION:
            raise ValueError(f"pin file version {d['version']}")
        expires = d["expires_at"]
        return Pin(
            str(d["pin_id"]),
            bytes.fromhex(d["root"]),
            tuple(bytes.fromhex(h) for h in d["pages"]),
            int(d["page_file_bytes"]),
            str(d.get("owner", "")),  # files of old versions held the salt: not read
            float(d["created_at"]),
            None if expires is None else float(expires),
        )
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a pin file: {exc}") from exc


def pin_id_of(pages: Iterable[bytes]) -> str:
    """A chain's pin id: its last page hash in hex."""
    *_, last = pages
    return last.hex()


class PinStore:
    """The pins of one namespace folder, cached until the folder changes or one expires."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self.dir = folder / PINS_DIR
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None  # (mtime_ns, inode) of pins/ when loaded
        self._loaded_at = 0.0
        self._pins: dict[str, Pin] = {}
        self._hashes: frozenset[bytes] = frozenset()

    def active(self) -> list[Pin]:
        """Unexpired pins, oldest first (expired pin files are removed on the way)."""
        with self._lock:
            self._refresh()
            return sorted(self._pins.values(), key=lambda p: (p.created_at, p.pin_id))

    def hashes(self) -> frozenset[bytes]:
        """Every page hash an unexpired pin names."""
        with self._lock:
            self._refresh()
            return self._hashes

    def write(self, pin: Pin) -> None:
        """Create or replace a pin (atomic: a reader sees the old or the new file)."""
        make_private_dir(self.dir)
        write_private_text(self.dir / (pin.pin_id + PIN_SUFFIX), pin_json(pin))
        self.invalidate()

    def remove(self, pin_ids: Iterable[str]) -> int:
        """Remove pins by id; how many were there."""
        removed = 0
        for pin_id in pin_ids:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / (pin_id + PIN_SUFFIX)).unlink()
                removed += 1
        self.invalidate()
        return removed

    def invalidate(self) -> None:
        with self._lock:
            self._seen = None

    def _refresh(self) -> None:
        now = self._clock()
        try:
            st = self.dir.stat()
            seen: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except FileNotFoundError:
            seen = (0, 0)
        fresh = now - self._loaded_at < _RELOAD_S
        if seen == self._seen and fresh and not any(p.expired(now) for p in self._pins.values()):
            return
        self._pins = {p.pin_id: p for p in load_pins(self.dir, now)}
        self._hashes = frozenset(h for p in self._pins.values() for h in p.pages)
        self._seen = seen
        self._loaded_at = now


def load_pins(pins_dir: Path, now: float) -> list[Pin]:
    """The unexpired pins of a `pins/` folder; expired ones are removed, bad ones skipped."""
    pins = []
    for entry in scandir(pins_dir):
        if not entry.name.endswith(PIN_SUFFIX) or entry.name.startswith("."):
            continue
        path = Path(entry.path)
        try:
            pin = pin_from_json(path.read_text())
        except FileNotFoundError:
            continue  # unpinned meanwhile
        except (OSError, ValueError) as exc:
            log.warning("pin file %s skipped: %s", path, exc)
            continue
        if pin.expired(now):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            log.info("pin %s expired", pin.pin_id)
            continue
        pins.append(pin)
    return pins


def folder_pinned_bytes(root: Path, now: float, skip: tuple[Path, str] | None = None) -> int:
    """Bytes the unexpired pins of every namespace in `root` hold, each page once.

    `skip` leaves out one pin (namespace folder, pin id): the one being replaced.
    """
    total = 0
    for ns in namespace_folders(root):
        pages: dict[bytes, int] = {}
        for pin in load_pins(ns / PINS_DIR, now):
            if skip is not None and skip == (ns, pin.pin_id):
                continue
            pages.update(dict.fromkeys(pin.pages, pin.page_file_bytes))
        total += sum(pages.values())
    return total


@dataclass(frozen=True)
class PinLimit:
    """How much of the folder the pins may hold, and hold now."""

    pinned_bytes: int
    limit_bytes: int


def check_limit(root: Path, folder: Path, pin: Pin, limit_bytes: int, now: float) -> PinLimit:
    """The folder's pinned bytes with `pin` (replacing its namesake) added; raises
    PinLimitError when that passes `limit_bytes`. Call under the folder's ledger lock."""
    others = folder_pinned_bytes(root, now, skip=(folder, pin.pin_id))
    same_ns: dict[bytes, int] = {}
    for p in load_pins(folder / PINS_DIR, now):
        if p.pin_id != pin.pin_id:
            same_ns.update(dict.fromkeys(p.pages, p.page_file_bytes))
    extra = sum(pin.page_file_bytes for h in set(pin.pages) if h not in same_ns)
    after = others + extra
    if after > limit_bytes:
        raise PinLimitError(
            f"pinning {len(pin.pages)} pages ({extra / 1e6:.1f} MB more) would pin "
            f"{after / 1e6:.1f} MB of the disk tier; --max-pinned-fraction allows "
            f"{limit_bytes / 1e6:.1f} MB ({others / 1e6:.1f} MB pinned already)",
            after,
            limit_bytes,
        )
    return PinLimit(after, limit_bytes)
