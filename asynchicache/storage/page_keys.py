"""Keyed MACs on stored pages: who may write a page that every instance will serve.

The shared tiers (a disk folder several instances use, a Redis/Valkey that
several hosts reach) are writable by more than this process: another local
user with access to the folder, or any client of the Redis. The payload
checksum (xxh3) catches corruption, not forgery: anyone can compute it. With
`--cache-key-file`, every page also carries a MAC, AES-256-GMAC of the header
(with the MAC field zeroed) and the payload, under a key derived per
namespace from a secret in the key file; a reader holding the file serves
only pages whose MAC verifies (a page without one, or with one that does not
verify, is a miss, counted in `mac_failures`, and removed).

    key file   one secret per line (at least 32 characters; '#' starts a comment),
               owned by this user, readable by no one else (0600 or stricter)
    first line the current secret: new pages are signed with it
    the others older secrets: pages signed with them still verify (rotation)
    K_ns       HMAC-SHA256(secret, "asynchicache-page-mac" || namespace), once per namespace
    MAC field  nonce (12 random bytes per write) || tag (16) || 4 zero bytes, the tag
               AES-256-GCM under K_ns with no plaintext and header || payload as the
               associated data (GMAC, NIST SP 800-38D). Why GMAC: with AES-NI and
               carry-less multiplies OpenSSL authenticates ~30 GB/s on one core, 4x
               keyed BLAKE3 and 25x HMAC-SHA256, whose cost on every page made L4
               puts 1.5x slower; random nonces bound a key to ~2**32 writes, as
               encryption does (rotate before that)
    key id     8 bytes naming the secret in each header (so a reader picks its key)

Rotation: add the new secret as the first line on every instance sharing the
tiers and restart them (they sign with it and still read pages of the old
one); once the old pages have been rewritten or evicted, drop the old line.
A reader without a key file does not verify MACs (it checks the checksum
only): every instance that shares a tier must hold the same key file.

With `--cache-encrypt` (`PageKeys.encrypt`), the same secrets also derive a
per-namespace AES-256-GCM key (storage.page_cipher): pages are encrypted, and
the GCM tag of the ciphertext replaces the GMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from asynchicache.storage.page_cipher import NONCE_BYTES, TAG_BYTES, PageCipher, derive_key

KEY_ID_BYTES = 8
MAC_BYTES = 32
MIN_SECRET_CHARS = 32
_DERIVE = b"asynchicache-page-mac\x00"
_ID = b"asynchicache-key-id\x00"
_MAX_KEY_FILE = 1 << 16
_MAC_PAD = bytes(MAC_BYTES - NONCE_BYTES - TAG_BYTES)


class MacMismatch(str):
    """The problem text of a page whose MAC is missing or does not verify."""


def key_id(secret: bytes) -> bytes:
    return hashlib.sha256(_ID + secret).digest()[:KEY_ID_BYTES]


@dataclass(frozen=True)
class PageKeys:
    """The secrets of a key file: the first signs, all verify; `encrypt`: pages are also
    encrypted (--cache-encrypt, storage.page_cipher)."""

    secrets: tuple[bytes, ...]
    encrypt: bool = False

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("--cache-key-file holds no key")
        for s in self.secrets:
            if len(s) < MIN_SECRET_CHARS:
                raise ValueError(
                    f"--cache-key-file: every key must have at least {MIN_SECRET_CHARS} "
                    f"characters (e.g. `openssl rand -hex 32`), got one of {len(s)}"
                )

    @classmethod
    def load(cls, path: Path, encrypt: bool = False) -> PageKeys:
        """Read a key file, refusing one another user owns or others may read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"--cache-key-file {path}: cannot open ({exc})") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ValueError(f"--cache-key-file {path} must be a file owned by this user")
            if st.st_mode & 0o077:
                raise ValueError(
                    f"--cache-key-file {path} is readable or writable by others "
                    f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it"
                )
            raw = os.read(fd, _MAX_KEY_FILE + 1)
        finally:
            os.close(fd)
        if len(raw) > _MAX_KEY_FILE:
            raise ValueError(f"--cache-key-file {path} is larger than {_MAX_KEY_FILE} bytes")
        lines = (line.split(b"#", 1)[0].strip() for line in raw.splitlines())
        return cls(tuple(line for line in lines if line), encrypt)

    def for_namespace(self, namespace: bytes) -> NamespaceKeys:
        ids = [key_id(s) for s in self.secrets]
        macs = {
            i: hmac.digest(s, _DERIVE + namespace, "sha256")
            for i, s in zip(ids, self.secrets, strict=True)
        }
        cipher = None
        if self.encrypt:
            aes = {i: derive_key(s, namespace) for i, s in zip(ids, self.secrets, strict=True)}
            cipher = PageCipher(ids[0], aes)
        return NamespaceKeys(ids[0], macs, cipher)


@dataclass(frozen=True)
class NamespaceKeys:
    """One namespace's MAC keys: `current` signs; any of `by_id` verifies; `cipher`, when
    pages are encrypted, holds the AES-GCM keys of the same secrets."""

    current: bytes  # key id
    by_id: dict[bytes, bytes] = field(repr=False)
    cipher: PageCipher | None = None

    def sign(self, header: bytes, payload: Sequence[memoryview] | memoryview) -> bytes:
        """The MAC field of a page signed now under the current key (a fresh nonce)."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._tag(self.current, nonce, header, payload) + _MAC_PAD

    def _tag(
        self,
        key_id: bytes,
        nonce: bytes,
        header: bytes,
        payload: Sequence[memoryview] | memoryview,
    ) -> bytes:
        """AES-256-GMAC of `header` (MAC field zeroed) and the payload."""
        gmac = Cipher(algorithms.AES(self.by_id[key_id]), modes.GCM(nonce)).encryptor()
        gmac.authenticate_additional_data(header)
        for part in [payload] if isinstance(payload, memoryview) else payload:
            gmac.authenticate_additional_data(part)
        gmac.finalize()
        return gmac.tag

    def problem(self, key_id: bytes, mac: bytes, header: bytes, payload: memoryview) -> str | None:
        """Why a page's MAC does not verify (a `MacMismatch`), or None."""
        if key_id not in self.by_id:
            why = "no MAC" if not any(key_id) else "MAC under a key not in --cache-key-file"
            return MacMismatch(why)
        nonce, tag = mac[:NONCE_BYTES], mac[NONCE_BYTES : NONCE_BYTES + TAG_BYTES]
        good = hmac.compare_digest(self._tag(key_id, nonce, header, payload), tag)
        if not good or mac[NONCE_BYTES + TAG_BYTES :] != _MAC_PAD:
            return MacMismatch("MAC does not verify")
        return None
