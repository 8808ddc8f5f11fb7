"""The page header: round trip, and any damage is a clean HeaderError."""

from __future__ import annotations

import hmac
import struct
from dataclasses import replace

import pytest
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from asynchicache.storage.base import PageLayout
from asynchicache.storage.header import (
    HEADER_ALIGN,
    MAGIC,
    HeaderError,
    PageHeader,
    decode_header,
    encode_header,
    encode_signed,
    mac_problem,
    open_page,
    payload_checksum,
    seal_page,
)
from asynchicache.storage.page_keys import PageKeys

LAYOUT = PageLayout("bfloat16", (30, 2, 16, 3, 64))


PARENT = bytes(range(100, 116))


def _header(
    tokens: tuple[int, ...] = (1, 2, 3), namespace: bytes = b"ns", parent: bytes = PARENT
) -> PageHeader:
    return PageHeader(
        namespace, bytes(range(16)), tokens, LAYOUT, 1234, payload_checksum(b"x"), parent
    )


def test_round_trip_and_alignment() -> None:
    h = _header()
    data = encode_header(h)
    assert len(data) == HEADER_ALIGN == h.header_len
    assert decode_header(data) == h


def test_parent_hash_round_trips_and_may_be_unknown() -> None:
    assert decode_header(encode_header(_header())).parent == PARENT
    assert decode_header(encode_header(_header(parent=b""))).parent == b""
    with pytest.raises(ValueError, match="parent"):
        encode_header(_header(parent=b"short"))
    with pytest.raises(ValueError, match="parent"):
        encode_header(_header(parent=bytes(16)))  # zeros mean "unknown": not a real parent


def test_version_1_header_is_rejected() -> None:
    """Files of the format before parent hashes are a miss (readers remove them)."""
    raw = bytearray(encode_header(_header()))
    struct.pack_into("<H", raw, len(MAGIC), 1)
    with pytest.raises(HeaderError, match="version 1"):
        decode_header(bytes(raw))


def test_long_header_grows_in_aligned_blocks() -> None:
    h = _header(tokens=tuple(range(2000)))
    data = encode_header(h)
    assert len(data) == 2 * HEADER_ALIGN
    assert decode_header(data) == h
    with pytest.raises(HeaderError, match="needs"):
        decode_header(data[:HEADER_ALIGN])


@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64).map(tuple),
    namespace=st.binary(min_size=1, max_size=200),
)
@settings(max_examples=60, deadline=None)
def test_round_trip_property(tokens: tuple[int, ...], namespace: bytes) -> None:
    h = _header(tokens, namespace)
    assert decode_header(encode_header(h)) == h


@given(st.binary(max_size=5000))
@settings(max_examples=200, deadline=None)
def test_random_bytes_are_a_header_error(data: bytes) -> None:
    with pytest.raises(HeaderError):
        decode_header(data)


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_any_flipped_byte_is_detected(data: st.DataObject) -> None:
    raw = bytearray(encode_header(_header()))
    meaningful = len(raw.rstrip(b"\0"))  # the zero padding carries nothing
    pos = data.draw(st.integers(0, meaningful - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(HeaderError):
        decode_header(bytes(raw))


def test_out_of_range_token_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="int32"):
        encode_header(_header(tokens=(2**40,)))


def test_the_mac_is_aes_gmac_of_the_unsigned_header_and_payload() -> None:
    """The MAC's definition (docs/security.md), recomputed from its parts: another
    implementation holding the key file can verify our pages."""
    secret = b"s" * 40
    keys = PageKeys((secret,)).for_namespace(b"ns")
    payload = memoryview(bytes(range(256)) * 64)
    header = PageHeader(b"ns", b"h" * 16, (1, 2, 3), PageLayout("float32", (4096,)),
                        len(payload), payload_checksum(payload))  # fmt: skip
    signed = decode_header(encode_signed(header, keys, payload))
    k_ns = hmac.digest(secret, b"asynchicache-page-mac\x00ns", "sha256")
    unsigned = encode_header(replace(signed, mac=b""))
    nonce, tag, pad = signed.mac[:12], signed.mac[12:28], signed.mac[28:]
    # GMAC: AES-GCM with no plaintext, everything as associated data; the result is the tag.
    assert AESGCM(k_ns).encrypt(nonce, b"", unsigned + payload.tobytes()) == tag
    assert pad == bytes(4)
    assert mac_problem(signed, keys, payload) is None
    again = decode_header(encode_signed(header, keys, payload))
    assert again.mac[:12] != nonce  # a fresh nonce per write
    for bad in (bytes(32), signed.mac[:12] + bytes(16) + pad, signed.mac[:28] + b"\x01" * 4):
        assert mac_problem(replace(signed, mac=bad), keys, payload) is not None
    flipped = bytearray(payload)
    flipped[-1] ^= 1
    assert mac_problem(signed, keys, memoryview(flipped)) is not None


def test_encryption_is_aes_gcm_under_the_derived_key_with_the_header_as_aad() -> None:
    """The encryption's definition (docs/security.md), recomputed with another AES-GCM
    implementation from the key file's secret alone."""
    secret = b"s" * 40
    keys = PageKeys((secret,), encrypt=True).for_namespace(b"ns")
    payload = memoryview(bytes(range(256)) * 64)
    header = PageHeader(b"ns", b"h" * 16, (1, 2, 3), PageLayout("float32", (4096,)),
                        len(payload), b"")  # fmt: skip
    raw, body = seal_page(header, keys, payload)
    sealed = decode_header(raw)
    assert sealed.encrypted and sealed.payload_checksum == bytes(16)
    assert sealed.mac[28:] == bytes(4)
    k_enc = hmac.digest(secret, b"asynchicache-page-enc\x00ns", "sha256")
    aad = encode_header(replace(sealed, mac=b""))
    nonce, tag = sealed.mac[:12], sealed.mac[12:28]
    assert AESGCM(k_enc).decrypt(nonce, bytes(body) + tag, aad) == payload.tobytes()
    dst = memoryview(bytearray(len(payload)))
    assert open_page(sealed, keys, body, dst) is None and dst == payload
    assert open_page(replace(sealed, tokens=(1, 2, 4)), keys, body, dst) is not None
    plain_keys = PageKeys((secret,)).for_namespace(b"ns")
    assert open_page(sealed, plain_keys, body, dst) == (
        "encrypted page (this reader has no --cache-encrypt)"
    )


def test_an_unknown_cipher_is_a_header_error() -> None:
    raw = bytearray(encode_header(_header()))
    n_fixed = struct.calcsize("<8sHIQ16s16s16s8s32sHIBBB")
    raw[n_fixed - 1] = 7
    # Re-stamp the header checksum, so that only the cipher byte is wrong.
    end = n_fixed + len(b"ns") + 4 * 3 + len(LAYOUT.dtype) + 4 * len(LAYOUT.shape)
    fixed = raw
    struct.pack_into("<Q", fixed, end, xxhash.xxh3_64_intdigest(bytes(fixed[:end])))
    with pytest.raises(HeaderError, match="cipher"):
        decode_header(bytes(fixed))


def test_the_encrypted_flag_round_trips_and_is_covered_by_the_header_checksum() -> None:
    h = replace(_header(), key_id=b"k" * 8, mac=b"m" * 32, encrypted=True)
    raw = encode_header(h)
    assert decode_header(raw) == h and not decode_header(encode_header(_header())).encrypted
    flipped = bytearray(raw)
    flipped[struct.calcsize("<8sHIQ16s16s16s8s32sHIBBB") - 1] ^= 1  # the cipher byte
    with pytest.raises(HeaderError):
        decode_header(bytes(flipped))
