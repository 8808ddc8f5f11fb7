"""Chained page hashes: the restart-stable, process-independent names of KV pages.

    h_0 = H(namespace)
    h_i = H(h_{i-1} || tokens of page i)

H is xxh3_128 (16-byte digests) over little-endian int32 token ids. Nothing here
depends on the process (no `hash()`, no random seed), so every process, restart
and instance computes the same names.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

KV_LAYOUT_VERSION = 1
HASH_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides a page's KV bytes."""

    model_fingerprint: str
    dtype: str
    page_size: int
    layout_version: int = KV_LAYOUT_VERSION
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")

    def encode(self) -> bytes:
        fields = (
            self.model_fingerprint,
            self.dtype,
            str(self.page_size),
            str(self.layout_version),
            self.cache_salt,
        )
        return "\x1f".join(fields).encode()

    def digest(self) -> bytes:
        """h_0 of every chain in this namespace."""
        return xxhash.xxh3_128_digest(b"asynchicache-ns\x00" + self.encode())

    def with_salt(self, cache_salt: str) -> Namespace:
        return Namespace(
            self.model_fingerprint, self.dtype, self.page_size, self.layout_version, cache_salt
        )


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian int32 encoding of token ids (the bytes that get hashed)."""
    arr = array("i", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every platform we run on has 4-byte C int
        raise RuntimeError("array('i') is not 32-bit on this platform")
    return arr.tobytes()


def chain_hashes(
    parent: bytes, tokens: Sequence[int], page_size: int, start_page: int = 0
) -> list[bytes]:
    """Hashes of the full pages of `tokens` from `start_page` on, chained from `parent`.

    `parent` is the hash of page `start_page - 1` (or the namespace digest when
    `start_page == 0`). A trailing partial page gets no hash.
    """
    n_pages = len(tokens) // page_size
    if start_page >= n_pages:
        return []
    raw = tokens_bytes(tokens[start_page * page_size : n_pages * page_size])
    step = page_size * 4
    digest = xxhash.xxh3_128_digest
    out = []
    h = parent
    for off in range(0, len(raw), step):
        h = digest(h + raw[off : off + step])
        out.append(h)
    return out


def page_hashes(namespace: Namespace, tokens: Sequence[int]) -> list[bytes]:
    """Hashes of every full page of `tokens` in `namespace`."""
    return chain_hashes(namespace.digest(), tokens, namespace.page_size)
