"""Chained page hashes: the restart-stable, process-independent names of KV pages.

    h_0 = H(namespace)
    h_i = H(h_{i-1} || tokens of page i)

H is xxh3_128 (16-byte digests) over little-endian int32 token ids. Nothing here
depends on the process (no `hash()`, no random seed), so every process, restart
and instance computes the same names.

The namespace is everything besides the tokens that decides a page's bytes:
the weights (fingerprint), dtype, page size, the KV layout, the engine that
computed the KV and the version of its arithmetic, and an optional salt. A
page computed by other code is another page: a disk folder that survives an
upgrade of the numerics is a miss, never stale KV served as a hit.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

# 2: the namespace names the engine and its numerics; page headers carry the parent hash.
KV_LAYOUT_VERSION = 2
# Our engine's marker. Pages computed by another engine (the vLLM connector's) carry
# another marker, so the two never share a page even for the same model and dtype.
ENGINE = "asynchicache"
# The version of our engine's K/V arithmetic (model/: norms, rotary, attention
# inputs, weight dequantization). Bump it whenever the K/V a prompt produces changes;
# tests/engine/test_numerics.py fails when the reference K/V moved without a bump.
#   1: one-pass RMSNorm, in-place rotary (the first versioned numerics)
#   2: linear layers through oneDNN with reordered weights (model/gemm.py)
#   3: attention read in place by the native paged kernel (model/native.py);
#      an engine without it (no C compiler, another dtype or device) attends with
#      torch and keeps 2, so the two never share a page
#   4: the native kernel's prompt rows in lanes (scores in the same order, the softmax's
#      running sums lane-wise): other last bits than 3
#   5: with the native kernel, the row-wise steps (RMSNorm, residual add, SiLU * up,
#      rotary) in the native row kernels (model/row_ops.py): other last bits
#   6: the native kernels built for 8-lane vectors (AVX2, model/kernels/vec.h):
#      keys in chunks of 8 and reduction trees of 8 lanes, other last bits than 5 (the
#      16-lane build of AVX-512 hosts, and of hosts without AVX2)
NUMERICS_VERSION = 2
NATIVE_NUMERICS_VERSION = 5
NATIVE8_NUMERICS_VERSION = 6
HASH_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides a page's KV bytes."""

    model_fingerprint: str
    dtype: str
    page_size: int
    layout_version: int = KV_LAYOUT_VERSION
    cache_salt: str = ""
    engine: str = ENGINE
    numerics_version: int = NUMERICS_VERSION

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if not self.engine or "\x1f" in self.engine:
            raise ValueError(f"engine marker must be non-empty without \\x1f, got {self.engine!r}")

    def encode(self) -> bytes:
        """The namespace's bytes (in every page header; the disk folder is named after them)."""
        fields = (
            self.model_fingerprint,
            self.dtype,
            str(self.page_size),
            str(self.layout_version),
            self.cache_salt,
            self.engine,
            str(self.numerics_version),
        )
        return "\x1f".join(fields).encode()

    @classmethod
    def decode(cls, data: bytes) -> Namespace:
        """The inverse of `encode` (a page header's namespace); ValueError when it is not one."""
        try:
            fields = data.decode().split("\x1f")
            fp, dtype, page_size, layout, salt, engine, numerics = fields
            return cls(fp, dtype, int(page_size), int(layout), salt, engine, int(numerics))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"not a namespace of this version: {data[:80]!r}") from exc

    def digest(self) -> bytes:
        """h_0 of every chain in this namespace."""
        return namespace_digest(self.encode())

    def with_salt(self, cache_salt: str) -> Namespace:
        return replace(self, cache_salt=cache_salt)


def namespace_digest(encoded: bytes) -> bytes:
    """h_0 of the namespace whose `encode()` is `encoded`."""
    return xxhash.xxh3_128_digest(b"asynchicache-ns\x00" + encoded)


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
