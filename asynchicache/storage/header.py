"""The self-describing header in front of every stored page (disk files, remote values).

Layout (little-endian), padded with zeros to `header_len`, a multiple of 4096
so the payload starts on a page boundary (O_DIRECT-friendly, and a default
model page of 737,280 bytes is itself 180 x 4096):

    fixed    magic 8s | version u16 | header_len u32 | payload_len u64
             payload_checksum 16s (xxh3_128) | page_hash 16s | parent_hash 16s
             key_id 8s | mac 32s (zeros: unsigned)
             ns_len u16 | n_tokens u32 | dtype_len u8 | ndim u8 | cipher u8
    variable namespace | tokens (int32 each) | dtype (ascii) | shape (u32 each)
    check    xxh3_64 of everything above (u64)

The header checksum protects the tokens and the payload checksum; the payload
checksum protects the KV bytes. `parent_hash` is the hash the page's hash was
chained from (the previous page's, or the namespace digest for a first page;
zeros when unknown), so a folder's chains can be rebuilt and audited
(`asynchicache cache verify --deep`). `key_id` and `mac` are the keyed MAC of
storage.page_keys (AES-GMAC of this header with the MAC zeroed, then the
payload: the nonce and tag in the MAC field), when the writer has
`--cache-key-file`. `cipher` 1 says the payload is AES-256-GCM ciphertext
(`--cache-encrypt`, storage.page_cipher): then `mac` holds the GCM nonce and
tag (this header with the MAC zeroed is the associated data) and
`payload_checksum` is zeros. Files of versions 1 (no parent), 2 (no MAC
fields), 3 (HMAC-SHA256 MACs), 4 (no cipher field) and 5 (keyed BLAKE3 MACs)
are a miss.
Decoding never evaluates anything (no pickle): a header that does not parse is
a `HeaderError`, which readers treat as a miss.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from asynchicache.storage.base import PageLayout
from asynchicache.storage.page_keys import KEY_ID_BYTES, MAC_BYTES, MacMismatch, NamespaceKeys

# Anything exposing the buffer protocol (collections.abc.Buffer is 3.12+).
Buffer = bytes | bytearray | memoryview

MAGIC = b"ACKVPAGE"
FORMAT_VERSION = 6  # 2: parent; 3: key_id, mac; 4: BLAKE3; 5: cipher; 6: GMAC
HEADER_ALIGN = 4096
PAGE_HASH_BYTES = 16
_FIXED = struct.Struct("<8sHIQ16s16s16s8s32sHIBBB")
CIPHER_NONE, CIPHER_AES_GCM = 0, 1
_NO_PARENT = bytes(PAGE_HASH_BYTES)
_NO_KEY = bytes(KEY_ID_BYTES)
_NO_MAC = bytes(MAC_BYTES)
_NO_CHECKSUM = bytes(16)
_CHECK = struct.Struct("<Q")
_MAX_HEADER = 1 << 20


class HeaderError(ValueError):
    """The bytes are not a valid page header (garbage, truncated, other version)."""


class HeaderVersionError(HeaderError):
    """A page header of another format version (written by older or newer code)."""


@dataclass(frozen=True)
class PageHeader:
    """Everything needed to trust a stored page without knowing where it came from."""

    namespace: bytes
    page_hash: bytes
    tokens: tuple[int, ...]
    layout: PageLayout
    payload_len: int
    payload_checksum: bytes
    parent: bytes = b""  # the previous page's hash (b"": unknown)
    key_id: bytes = b""  # the MAC's key (storage.page_keys); b"": unsigned
    mac: bytes = b""  # encrypted: GCM nonce || tag (storage.page_cipher)
    encrypted: bool = False  # the payload is AES-256-GCM ciphertext

    @property
    def header_len(self) -> int:
        return header_len_for(len(self.namespace), len(self.tokens), self.layout)

    def mismatch(
        self, namespace: bytes, layout: PageLayout, page_hash: bytes, named_by: str
    ) -> str | None:
        """Why this is not the header of page `page_hash` of `namespace` stored in `layout`,
        or None; `named_by` is where the reader got `page_hash` ("the file name", "the key")."""
        if self.namespace != namespace:
            return "page of another namespace"
        if self.page_hash != page_hash:
            return f"page hash does not match {named_by}"
        if self.layout != layout:
            return f"layout {self.layout} != {layout}"
        if self.payload_len != layout.page_bytes:
            return f"payload length {self.payload_len} != {layout.page_bytes}"
        return None


def payload_checksum(payload: Buffer) -> bytes:
    """xxh3_128 of the page bytes (about 30 GB/s, so verifying every read is cheap)."""
    return xxhash.xxh3_128_digest(payload)


def header_len_for(ns_len: int, n_tokens: int, layout: PageLayout) -> int:
    raw = (
        _FIXED.size
        + ns_len
        + 4 * n_tokens
        + len(layout.dtype.encode())
        + 4 * len(layout.shape)
        + _CHECK.size
    )
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def encode_header(header: PageHeader) -> bytes:
    """The header bytes, zero-padded to `header.header_len`."""
    if len(header.page_hash) != PAGE_HASH_BYTES:
        raise ValueError(f"page hash must be {PAGE_HASH_BYTES} bytes")
    if len(header.parent) not in (0, PAGE_HASH_BYTES) or header.parent == _NO_PARENT:
        raise ValueError(f"parent hash must be {PAGE_HASH_BYTES} non-zero bytes or empty")
    if len(header.key_id) not in (0, KEY_ID_BYTES) or len(header.mac) not in (0, MAC_BYTES):
        raise ValueError(f"key id and MAC must be {KEY_ID_BYTES} and {MAC_BYTES} bytes or empty")
    dtype = header.layout.dtype.encode()
    header_len = header.header_len
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        header_len,
        header.payload_len,
        header.payload_checksum,
        header.page_hash,
        header.parent or _NO_PARENT,
        header.key_id or _NO_KEY,
        header.mac or _NO_MAC,
        len(header.namespace),
        len(header.tokens),
        len(dtype),
        len(header.layout.shape),
        CIPHER_AES_GCM if header.encrypted else CIPHER_NONE,
    )
    try:
        tokens = array("i", header.tokens).tobytes()
    except OverflowError as exc:
        raise ValueError(f"token id out of int32 range: {exc}") from exc
    body = b"".join(
        (fixed, header.namespace, tokens, dtype, array("I", header.layout.shape).tobytes())
    )
    body += _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    return body + bytes(header_len - len(body))


def peek_header_len(data: Buffer) -> int:
    """The header length announced by `data` (which holds at least the fixed part)."""
    view = memoryview(data).cast("B")
    if len(view) < _FIXED.size:
        raise HeaderError(f"short header: {len(view)} bytes")
    magic, version, header_len, *_ = _FIXED.unpack_from(view)
    _check_prologue(magic, version, header_len)
    return int(header_len)


def decode_header(data: Buffer) -> PageHeader:
    """Parse and verify a header; `data` must hold at least `header_len` bytes."""
    view = memoryview(data).cast("B")
    header_len = peek_header_len(view)
    if len(view) < header_len:
        raise HeaderError(f"header needs {header_len} bytes, got {len(view)}")
    (_, _, _, payload_len, checksum, page_hash, parent, kid, mac, ns_len, n_tokens, dtype_len,
     ndim, cipher) = _FIXED.unpack_from(view)  # fmt: skip
    if cipher not in (CIPHER_NONE, CIPHER_AES_GCM):
        raise HeaderError(f"unknown cipher {cipher}")
    end = _FIXED.size + ns_len + 4 * n_tokens + dtype_len + 4 * ndim
    if end + _CHECK.size > header_len:
        raise HeaderError("header fields overrun the header")
    (stored_check,) = _CHECK.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored_check:
        raise HeaderError("header checksum mismatch")
    padding = view[end + _CHECK.size : header_len]
    if padding.tobytes() != bytes(len(padding)):  # outside the checksum: a flip must not pass
        raise HeaderError("non-zero header padding")
    pos = _FIXED.size
    namespace = bytes(view[pos : pos + ns_len])
    pos += ns_len
    tokens = tuple(array("i", bytes(view[pos : pos + 4 * n_tokens])))
    pos += 4 * n_tokens
    dtype = bytes(view[pos : pos + dtype_len]).decode("ascii", errors="replace")
    pos += dtype_len
    shape = tuple(array("I", bytes(view[pos : pos + 4 * ndim])))
    try:
        layout = PageLayout(dtype, shape)
    except ValueError as exc:
        raise HeaderError(f"bad layout in header: {exc}") from exc
    parent = b"" if parent == _NO_PARENT else parent
    kid = b"" if kid == _NO_KEY else kid
    mac = b"" if mac == _NO_MAC else mac
    return PageHeader(
        namespace,
        page_hash,
        tokens,
        layout,
        payload_len,
        checksum,
        parent,
        kid,
        mac,
        cipher == CIPHER_AES_GCM,
    )


def encode_signed(
    header: PageHeader, keys: NamespaceKeys | None, payload: memoryview | Sequence[memoryview]
) -> bytes:
    """`encode_header`, with the MAC of `keys.current` over it and the payload when keyed."""
    if keys is None:
        return encode_header(header)
    unsigned = replace(header, key_id=keys.current, mac=b"")
    mac = keys.sign(encode_header(unsigned), payload)
    return encode_header(replace(unsigned, mac=mac))


def mac_problem(header: PageHeader, keys: NamespaceKeys | None, payload: memoryview) -> str | None:
    """Why a page read with `keys` is not signed by one of them (a `MacMismatch`), or None
    (always None without keys: such a reader checks the checksum only)."""
    if keys is None:
        return None
    unsigned = encode_header(replace(header, mac=b""))
    return keys.problem(header.key_id, header.mac, unsigned, payload)


def seal_page(
    header: PageHeader, keys: NamespaceKeys | None, payload: memoryview, buffer: int = 0
) -> tuple[bytes, memoryview]:
    """The header bytes and the body to store after them for `payload`: the payload
    itself, checksummed (and signed when keyed), or, when `keys` encrypt, its AES-GCM
    ciphertext in this thread's scratch buffer `buffer` (a pipelined batch sent at once
    uses one per page). `header`'s checksum and MAC fields are filled here."""
    if keys is None or keys.cipher is None:
        signed = replace(header, payload_checksum=payload_checksum(payload))
        return encode_signed(signed, keys, payload), payload
    cipher = keys.cipher
    unsealed = replace(
        header, payload_checksum=_NO_CHECKSUM, key_id=cipher.current, mac=b"", encrypted=True
    )
    body = cipher.scratch.get(buffer, len(payload))
    sealed = cipher.seal_into(encode_header(unsealed), payload, body)
    return encode_header(replace(unsealed, mac=sealed + bytes(MAC_BYTES - len(sealed)))), body


def open_page(
    header: PageHeader, keys: NamespaceKeys | None, body: memoryview, dst: memoryview
) -> str | None:
    """Check a stored page's `body` and leave its plaintext in `dst`; why it is not
    servable, or None. `body` is where the caller received the payload: `body_buffer`.

    A MAC or GCM tag that does not verify, or a plain page where pages must be
    encrypted, is a `MacMismatch` (counted); an encrypted page met by a reader without
    --cache-encrypt is a plain miss (a peer configured otherwise, not a forgery)."""
    if header.encrypted:
        if keys is None or keys.cipher is None:
            return "encrypted page (this reader has no --cache-encrypt)"
        why = keys.cipher.open_into(header.key_id, header.mac, associated_data(header), body, dst)
        return None if why is None else MacMismatch(why)
    if keys is not None and keys.cipher is not None:
        return MacMismatch("page not encrypted (--cache-encrypt wants every page encrypted)")
    forged = mac_problem(header, keys, body)
    if keys is not None and forged is None:
        return None  # the MAC covers the payload and the header's checksum of it
    if payload_checksum(body) != header.payload_checksum:
        return "payload checksum mismatch"  # damaged (counted as corrupt), not forged
    return forged


def associated_data(header: PageHeader) -> bytes:
    """What an encrypted page's GCM tag authenticates besides the ciphertext: its encoded
    header with the MAC field (nonce and tag) zeroed."""
    return encode_header(replace(header, mac=b""))


def body_buffer(keys: NamespaceKeys | None, dst: memoryview) -> memoryview:
    """Where a reader with `keys` receives a payload bound for `dst`: `dst` itself, or
    this thread's scratch buffer when pages are encrypted (then `open_page` decrypts it
    into `dst`)."""
    if keys is None or keys.cipher is None:
        return dst
    return keys.cipher.scratch.get(0, len(dst))


def _check_prologue(magic: bytes, version: int, header_len: int) -> None:
    if magic != MAGIC:
        raise HeaderError("bad magic (not a page file)")
    if version != FORMAT_VERSION:
        raise HeaderVersionError(f"unsupported format version {version}")
    if header_len % HEADER_ALIGN or not 0 < header_len <= _MAX_HEADER:
        raise HeaderError(f"bad header length {header_len}")
