"""Encryption at rest of stored pages: who may read the KV that a shared tier holds.

With `--cache-encrypt` (which needs `--cache-key-file`), every L3 page file and
L4 value stores its payload encrypted with AES-256-GCM; the page header
(storage.header) stays plaintext, is authenticated as the GCM associated data,
and says the page is encrypted. The GCM tag takes the place of the
GMAC (storage.page_keys): one pass over the payload, not two.

    K_enc      HMAC-SHA256(secret, "asynchicache-page-enc" || namespace), once per
               namespace and secret (a different label than the MAC key's)
    nonce      12 random bytes per write (os.urandom): below 2**32 writes per key the
               chance of a repeat is under 2**-32 (NIST SP 800-38D, 8.3)
    AAD        the encoded header with its MAC field zeroed (namespace, page hash,
               parent, token ids, layout, key id, the encrypted flag)
    MAC field  nonce (12) || tag (16) || 4 zero bytes
    checksum   zeros: an xxh3 of the plaintext would fingerprint it, and the tag
               already covers every ciphertext byte

Invariants: a page's plaintext is written only into the caller's destination
(its L2 slot), and its tag is checked after the last byte (an L4 read decrypts
piece by piece as the bytes arrive); a tag that does not verify is a
`MacMismatch` (counted in `mac_failures`, the page a miss), and the
destination then holds garbage that no caller may use. Ciphertext goes through per-thread scratch
buffers (`CipherScratch`), never a new object per page: `update_into` writes
straight into them and OpenSSL releases the GIL, so I/O threads overlap.
"""

from __future__ import annotations

import hmac
import mmap
import os
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    Cipher,
    algorithms,
    modes,
)

NONCE_BYTES = 12
TAG_BYTES = 16
# A received ciphertext is decrypted in pieces of this size as they arrive, each while it
# is still in the CPU's cache (measured: ~0.6x the time of receiving a whole page, then
# decrypting it).
RECEIVE_CHUNK = 128 * 1024
UNKNOWN_KEY = "encrypted under a key not in --cache-key-file"
_DERIVE = b"asynchicache-page-enc\x00"


def derive_key(secret: bytes, namespace: bytes) -> bytes:
    """The AES-256 key of `namespace` under `secret`."""
    return hmac.digest(secret, _DERIVE + namespace, "sha256")


class CipherScratch(threading.local):
    """Per-thread page-sized buffers for ciphertext (mmap: page-aligned, so O_DIRECT works).

    `get(i, size)` is buffer `i` of this thread (a pipelined batch of SETs holds one per
    page until it is sent); it grows once and is reused after."""

    def __init__(self) -> None:
        self.blocks: list[mmap.mmap] = []

    def get(self, i: int, size: int) -> memoryview:
        while len(self.blocks) <= i:
            self.blocks.append(mmap.mmap(-1, size))
        if len(self.blocks[i]) < size:
            self.blocks[i] = mmap.mmap(-1, size)
        return memoryview(self.blocks[i])[:size]


class PageCipher:
    """One namespace's AES-256-GCM keys: `current` encrypts; any of `by_id` decrypts."""

    def __init__(self, current: bytes, by_id: dict[bytes, bytes]) -> None:
        self.current = current  # key id (storage.page_keys.key_id)
        self._algs = {kid: algorithms.AES(key) for kid, key in by_id.items()}
        self.scratch = CipherScratch()

    def __repr__(self) -> str:
        return f"PageCipher(current={self.current.hex()}, keys={len(self._algs)})"

    def seal_into(self, aad: bytes, src: memoryview, dst: memoryview) -> bytes:
        """Encrypt `src` into `dst` (same length) under the current key; nonce || tag."""
        nonce = os.urandom(NONCE_BYTES)
        enc = Cipher(self._algs[self.current], modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        enc.update_into(src, dst)
        enc.finalize()
        return nonce + enc.tag

    def decryptor(self, key_id: bytes, sealed: bytes, aad: bytes) -> AEADDecryptionContext | None:
        """A decryption of one page (feed it with `update_into`, end with `finish`), or None
        when `key_id` is not one of ours."""
        alg = self._algs.get(key_id)
        if alg is None:
            return None
        nonce, tag = sealed[:NONCE_BYTES], sealed[NONCE_BYTES : NONCE_BYTES + TAG_BYTES]
        dec = Cipher(alg, modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        return dec

    def open_into(
        self, key_id: bytes, sealed: bytes, aad: bytes, src: memoryview, dst: memoryview
    ) -> str | None:
        """Decrypt `src` into `dst` and check the tag; why it does not verify, or None."""
        dec = self.decryptor(key_id, sealed, aad)
        if dec is None:
            return UNKNOWN_KEY
        dec.update_into(src, dst)
        return finish(dec)


def finish(dec: AEADDecryptionContext) -> str | None:
    """Check the tag at the end of a decryption; why it does not verify, or None."""
    try:
        dec.finalize()
    except InvalidTag:
        return "does not decrypt (GCM tag does not verify)"
    return None
