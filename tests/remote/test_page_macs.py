"""Issue 39, finding 9: pages in the shared tiers carry a keyed MAC (`--cache-key-file`).

Anyone who can write to the Redis, or to a shared disk folder, can store a value under a
real page's name; without a MAC every instance served it as a hit (the checksum is
unkeyed). With a key file, a planted value (right name, wrong KV: unsigned, or signed
with another key) is a miss, counted in `mac_failures`, with a real Redis and a real
folder. Pages signed with an older key of the file still verify (rotation); a value of the
previous format version is a clean miss.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
from keyed_tiers import mac_failures, read_back
from pools import Pool, new_hashes, refs
from redis_server import RedisServer

from asynchicache.storage.disk.disk_backend import DiskBackend
from asynchicache.storage.page_keys import PageKeys
from asynchicache.storage.remote.remote_backend import RedisBackend

OLD = b"old-secret-" + b"o" * 32
NEW = b"new-secret-" + b"n" * 32
OTHER = b"someone-elses-" + b"x" * 32

Disks = Callable[..., DiskBackend]
Remotes = Callable[..., RedisBackend]


def test_a_planted_page_file_is_a_counted_miss(
    disks: Disks, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    hashes = new_hashes(4)
    planter = disks()  # a local user who can write the folder, without the key file
    assert planter.put(refs(hashes[:2], [0, 1]), pool.array) == 2
    other_key = disks(OTHER)  # ...or with a key file of their own
    assert other_key.put(refs(hashes[2:], [2, 3]), pool.array) == 2
    assert planter.path_of(hashes[0]).exists()  # the right name

    reader = disks(NEW)
    for h in hashes:
        assert read_back(reader, [h], pool) == 0
    assert mac_failures(reader) == 4
    assert not any(reader.path_of(h).exists() for h in hashes)  # removed


def test_a_planted_redis_value_is_a_counted_miss(
    remotes: Remotes, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    hashes = new_hashes(4)
    assert remotes().put(refs(hashes[:2], [0, 1]), pool.array) == 2  # a Redis peer, no key
    assert remotes(OTHER).put(refs(hashes[2:], [2, 3]), pool.array) == 2
    reader = remotes(NEW)
    assert reader.exists(hashes[:1]) == 1  # the right name
    for h in hashes:
        assert read_back(reader, [h], pool) == 0
    assert mac_failures(reader) == 4
    assert reader.stats().corrupt_detected >= 4


def test_signed_pages_verify_and_rotation_keeps_old_ones(
    disks: Disks, remotes: Remotes, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    old_d, old_r = new_hashes(2), new_hashes(2)
    assert disks(OLD).put(refs(old_d, [0, 1]), pool.array) == 2
    assert remotes(OLD).put(refs(old_r, [2, 3]), pool.array) == 2
    new_d, new_r = new_hashes(2), new_hashes(2)
    rotated_d, rotated_r = disks(NEW, OLD), remotes(NEW, OLD)  # the new key signs
    assert rotated_d.put(refs(new_d, [4, 5]), pool.array) == 2
    assert rotated_r.put(refs(new_r, [6, 7]), pool.array) == 2

    for backend, hashes, slots in ((rotated_d, old_d + new_d, [0, 1, 4, 5]),
                                   (rotated_r, old_r + new_r, [2, 3, 6, 7])):  # fmt: skip
        assert read_back(backend, hashes, pool) == 4
        assert np.array_equal(pool.array[8:12], pool.array[slots])
        assert mac_failures(backend) == 0
    # Once the old key is dropped, its pages are misses (and go); the new key's stay.
    assert read_back(remotes(NEW), old_r, pool) == 0
    assert read_back(remotes(NEW), new_r, pool) == 2


@pytest.mark.parametrize(
    "version", [2, 3, 4, 5], ids=["no-mac-fields", "hmac-sha256", "no-cipher", "blake3-mac"]
)
def test_a_value_of_a_previous_format_is_a_clean_miss(
    disks: Disks,
    remotes: Remotes,
    redis_server: RedisServer,
    make_pool: Callable[..., Pool],
    version: int,
) -> None:
    pool = make_pool(16, fill=8)
    hashes = new_hashes(2)
    writer_d, writer_r = disks(NEW), remotes(NEW)
    assert writer_d.put(refs(hashes[:1], [0]), pool.array) == 1
    assert writer_r.put(refs(hashes[1:], [1]), pool.array) == 1
    # The same bytes, announcing format version 2 (before MACs), 3 (HMAC-SHA256 MACs) or 4.
    path = writer_d.path_of(hashes[0])
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 8, version)
    path.write_bytes(bytes(raw))
    client = redis.Redis.from_url(redis_server.url)
    key = writer_r.key(hashes[1])
    value = bytearray(client.get(key) or b"")
    struct.pack_into("<H", value, 8, version)
    client.set(key, bytes(value))
    client.close()

    reader_d, reader_r = disks(NEW), remotes(NEW)
    assert read_back(reader_d, hashes[:1], pool) == 0
    assert read_back(reader_r, hashes[1:], pool) == 0
    assert not path.exists()
    assert mac_failures(reader_d) == 0 and mac_failures(reader_r) == 0  # not "planted"


def test_a_key_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_bytes(b"# current\n" + NEW + b"\n" + OLD + b"  # retiring\n")
    f.chmod(0o600)
    assert PageKeys.load(f).secrets == (NEW, OLD)
    f.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        PageKeys.load(f)
    f.chmod(0o600)
    f.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 32"):
        PageKeys.load(f)
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(ValueError, match="cannot open"):
        PageKeys.load(link)
    assert os.path.exists(f)
