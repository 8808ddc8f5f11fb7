"""`TenantKey`: names a tenant (a `cache_salt`) in listings without showing its salt.

A `cache_salt` is the tenant's secret: whoever knows it reads that tenant's cached
prefixes (`/cache/lookup`, `cached_tokens`). Pins still need an owner an operator can
read, so they keep `owner = HMAC-SHA256(key, salt)` (hex, 128 bits), never the salt.
Keyed, the fingerprint cannot be checked against guessed salts offline; the key is
per deployment: one per disk folder, so every server and restart on the folder names a
tenant alike (`<root>/.tenant-key`, 32 random bytes, 0600, made once, atomically). A
server without a disk tier keeps its pins in L2 only, for its lifetime: its key is
random per process (`ephemeral`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from asynchicache.common.fileio import make_private_dir

log = logging.getLogger(__name__)

KEY_NAME = ".tenant-key"
KEY_BYTES = 32
OWNER_HEX = 32  # 128 bits of the HMAC


@dataclass(frozen=True)
class TenantKey:
    secret: bytes = field(repr=False)

    def owner(self, salt: str) -> str:
        """The fingerprint of `salt` ("" for no salt: the shared namespace)."""
        if not salt:
            return ""
        return hmac.new(self.secret, salt.encode(), hashlib.sha256).hexdigest()[:OWNER_HEX]

    @classmethod
    def ephemeral(cls) -> TenantKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def for_folder(cls, root: Path) -> TenantKey:
        """The folder's key, made on first use (a random one, with a warning, when the
        folder cannot hold it)."""
        path = root / KEY_NAME
        try:
            return cls(_read(path) or _create(path))
        except OSError as exc:
            log.warning("no tenant key in %s (%s): pin owners are named for this run only",
                        root, exc.strerror)  # fmt: skip
            return cls.ephemeral()


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) != KEY_BYTES:
        raise OSError(0, f"{path} is not a tenant key ({len(data)} bytes)")
    return data


def _create(path: Path) -> bytes:
    """Write a new key under a temp name, then link it in: a second maker (another server
    on the folder) loses the race cleanly and reads the winner's whole key."""
    make_private_dir(path.parent)
    tmp = path.with_name(f"{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    data = secrets.token_bytes(KEY_BYTES)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return _read(path) or data
        return data
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
