"""Issue 39, encryption at rest: `--cache-encrypt` stores L3 and L4 pages AES-256-GCM encrypted.

With a real Redis and a real folder: encrypted pages round-trip; the stored bytes hold
no plaintext of the page; a flipped ciphertext byte (or a header rewritten with a valid
checksum) is a miss counted in `mac_failures`; a reader without encryption meets an
encrypted page as a clean miss; a plain page met by an encrypting reader is a counted
miss; pages encrypted under an older secret of the key file still decrypt (rotation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis
from keyed_tiers import mac_failures, read_back
from pools import ALIGNED, SMALL, Pool, new_hashes, refs
from redis_server import RedisServer

from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_process import service_args
from asynchicache.settings.config import CacheConfig, ServiceTuning
from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.disk_backend import DiskBackend
from asynchicache.storage.header import decode_header, encode_header, peek_header_len
from asynchicache.storage.page_keys import PageKeys
from asynchicache.storage.remote.remote_backend import RedisBackend
from asynchicache.storage.service import service_cli
from asynchicache.storage.service.service_config import service_argv

OLD = b"old-secret-" + b"o" * 32
NEW = b"new-secret-" + b"n" * 32

Disks = Callable[..., DiskBackend]
Remotes = Callable[..., RedisBackend]


def _keys(secrets: tuple[bytes, ...], encrypt: bool) -> PageKeys | None:
    return PageKeys(secrets, encrypt) if secrets else None


@pytest.fixture
def encrypt_by_default() -> bool:
    return True


def _stored(backend: DiskBackend | RedisBackend, url: str, page_hash: bytes) -> bytes:
    if isinstance(backend, DiskBackend):
        return backend.path_of(page_hash).read_bytes()
    client = redis.Redis.from_url(url)
    try:
        return client.get(backend.key(page_hash)) or b""
    finally:
        client.close()


def _restore(backend: DiskBackend | RedisBackend, url: str, page_hash: bytes, raw: bytes) -> None:
    if isinstance(backend, DiskBackend):
        backend.path_of(page_hash).write_bytes(raw)
        return
    client = redis.Redis.from_url(url)
    client.set(backend.key(page_hash), raw)
    client.close()


@pytest.mark.parametrize("layout", [SMALL, ALIGNED], ids=["buffered", "aligned"])
def test_encrypted_pages_round_trip_and_hold_no_plaintext(
    disks: Disks,
    remotes: Remotes,
    redis_server: RedisServer,
    make_pool: Callable[..., Pool],
    layout: PageLayout,
) -> None:
    pool = make_pool(16, layout=layout, fill=8)
    for make in (disks, remotes):
        writer = make(NEW, layout=layout)
        hashes = new_hashes(4)
        assert writer.put(refs(hashes, [0, 1, 2, 3]), pool.array) == 4
        for i, h in enumerate(hashes):
            raw = _stored(writer, redis_server.url, h)
            header = decode_header(raw)
            assert header.encrypted and header.payload_checksum == bytes(16)
            assert header.tokens == tuple(range(4 * i, 4 * i + 4))  # plaintext, documented
            body = raw[peek_header_len(raw) :]
            assert len(body) == layout.page_bytes
            plain = pool.array[i].tobytes()
            assert body != plain and plain[:64] not in raw and plain[-64:] not in raw
        reader = make(NEW, layout=layout)
        assert read_back(reader, hashes, pool) == 4
        assert np.array_equal(pool.array[8:12], pool.array[0:4])
        assert mac_failures(reader) == 0


def test_a_flipped_ciphertext_byte_or_a_rewritten_header_is_a_counted_miss(
    disks: Disks, remotes: Remotes, redis_server: RedisServer, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    for make in (disks, remotes):
        writer = make(NEW)
        hashes = new_hashes(2)
        assert writer.put(refs(hashes, [0, 1]), pool.array) == 2
        raw = bytearray(_stored(writer, redis_server.url, hashes[0]))
        raw[-100] ^= 0x01  # one ciphertext bit
        _restore(writer, redis_server.url, hashes[0], bytes(raw))
        # Other token ids under a valid header checksum: the tag covers the header too.
        raw = _stored(writer, redis_server.url, hashes[1])
        n = peek_header_len(raw)
        forged = encode_header(replace(decode_header(raw), tokens=(9, 9, 9, 9)))
        _restore(writer, redis_server.url, hashes[1], forged + raw[n:])

        reader = make(NEW)
        for h in hashes:
            assert read_back(reader, [h], pool) == 0
        assert mac_failures(reader) == 2


def test_mixed_readers_miss_cleanly(
    disks: Disks, remotes: Remotes, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    for make in (disks, remotes):
        encrypted = new_hashes(2)
        assert make(NEW).put(refs(encrypted, [0, 1]), pool.array) == 2
        # A reader with the key file but no --cache-encrypt, and one with no key file.
        for reader, h in ((make(NEW, encrypt=False), encrypted[0]), (make(), encrypted[1])):
            assert read_back(reader, [h], pool) == 0
            assert mac_failures(reader) == 0  # a peer configured otherwise: no forgery
        # The other way round: a plain (signed) page is refused by an encrypting reader,
        # and counted (every peer of an encrypted tier should encrypt).
        plain = new_hashes(1)
        assert make(NEW, encrypt=False).put(refs(plain, [2]), pool.array) == 1
        reader = make(NEW)
        assert read_back(reader, plain, pool) == 0
        assert mac_failures(reader) == 1


def test_rotation_keeps_pages_of_an_older_secret(
    disks: Disks, remotes: Remotes, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    for make in (disks, remotes):
        old = new_hashes(2)
        assert make(OLD).put(refs(old, [0, 1]), pool.array) == 2
        new = new_hashes(2)
        rotated = make(NEW, OLD)  # the new secret encrypts, the old one still decrypts
        assert rotated.put(refs(new, [2, 3]), pool.array) == 2
        assert read_back(rotated, old + new, pool) == 4
        assert np.array_equal(pool.array[8:12], pool.array[0:4])
        assert mac_failures(rotated) == 0
        dropped = make(NEW)  # the old line removed: its pages are counted misses
        assert read_back(dropped, old[:1], pool) == 0
        assert mac_failures(dropped) == 1
        assert read_back(dropped, new, pool) == 2


def test_cache_encrypt_needs_a_key_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--cache-encrypt needs --cache-key-file"):
        CacheConfig(cache_encrypt=True)
    keys = tmp_path / "keys"
    cache = CacheConfig(disk_cache_dir=tmp_path, cache_key_file=keys, cache_encrypt=True)
    argv = service_argv(cache, ServiceTuning())
    assert argv[argv.index("--cache-key-file") + 1] == str(keys) and "--cache-encrypt" in argv


def test_the_vllm_connector_passes_encryption_to_the_service_it_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_encrypt needs cache_key_file"):
        ConnectorConfig.from_extra({"cache_encrypt": "true"})
    extra = {"cache_key_file": str(tmp_path / "keys"), "cache_encrypt": "true",
             "disk_cache_dir": str(tmp_path / "kv")}  # fmt: skip
    service = service_cli.config_from_args(service_args(ConnectorConfig.from_extra(extra)))
    assert service.cache_key_file == tmp_path / "keys" and service.cache_encrypt
