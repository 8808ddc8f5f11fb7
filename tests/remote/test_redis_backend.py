"""RedisBackend against a real redis-server: round trips, isolation, damage, TTL, URLs."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import redis
from pools import DEFAULT, NAMESPACE, SMALL, Pool, new_hashes, refs
from redis_server import RedisServer
from remote_helpers import Backends

from asynchicache.storage.header import HEADER_ALIGN
from asynchicache.storage.remote.remote_backend import RedisConfig, remote_key_prefix
from asynchicache.storage.remote.topology import parse_remote_url


def _raw(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port)


def test_round_trip_default_pages_byte_identical(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(24, DEFAULT, fill=12, seed=1)
    backend = remote_backends(redis_server.url, DEFAULT, batch_pages=4, io_threads=3)
    hashes = new_hashes(12)
    pages = refs(hashes, range(12), page_tokens=16)
    assert backend.put(pages, pool.array) == 12
    assert backend.exists(hashes) == 12
    tokens = backend.read(hashes, list(range(12, 24)), pool.array)
    assert np.array_equal(pool.array[12:24], pool.array[0:12])
    assert tokens == [p.tokens for p in pages]
    # Values are header + payload, under the namespace's prefix.
    value = _raw(redis_server).get(backend.key(hashes[0]))
    assert value is not None and len(value) == HEADER_ALIGN + DEFAULT.page_bytes
    assert bytes(pool.array[0]) == value[HEADER_ALIGN:]
    s = backend.stats()
    assert (s.pages_written, s.pages_read, s.hits, s.corrupt_detected) == (12, 12, 12, 0)
    assert s.bytes_read == 12 * DEFAULT.page_bytes


def test_chain_stops_at_first_missing_page(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(16, fill=8)
    backend = remote_backends(redis_server.url, batch_pages=2)
    hashes = new_hashes(8)
    assert backend.put(refs(hashes, range(8)), pool.array) == 8
    assert backend.delete([hashes[5]]) == 1
    assert backend.exists(hashes) == 5
    assert backend.get(hashes, list(range(8, 16)), pool.array) == 5
    assert np.array_equal(pool.array[8:13], pool.array[0:5])
    assert backend.stats().misses == 3


def test_put_skips_pages_already_stored(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8, fill=8)
    backend = remote_backends(redis_server.url)
    hashes = new_hashes(6)
    assert backend.put(refs(hashes[:4], range(4)), pool.array) == 4
    # A duplicate inside one call, and four pages already there: only two new writes.
    pages = refs(hashes, range(6))
    assert backend.put([*pages, pages[5]], pool.array) == 7
    assert backend.stats().pages_written == 6


def test_namespaces_are_isolated(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8, fill=4)
    a = remote_backends(redis_server.url, namespace=b"model-a")
    b = remote_backends(redis_server.url, namespace=b"model-b")
    assert a.prefix != b.prefix
    hashes = new_hashes(4)
    assert a.put(refs(hashes, range(4)), pool.array) == 4
    assert b.exists(hashes) == 0
    assert b.get(hashes, [4, 5, 6, 7], pool.array) == 0
    assert b.put(refs(hashes, range(4)), pool.array) == 4  # same hashes, its own keys
    assert b.clear().removed == 4
    assert a.exists(hashes) == 4
    # The same namespace with another page layout is another prefix too.
    assert remote_key_prefix(b"model-a", SMALL) != remote_key_prefix(b"model-a", DEFAULT)


@pytest.mark.parametrize(
    ("offset", "what"),
    [(HEADER_ALIGN + 100, "payload"), (40, "header"), (0, "magic")],
)
def test_corrupted_value_is_a_miss_and_deleted(
    redis_server: RedisServer,
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
    offset: int,
    what: str,
) -> None:
    pool = make_pool(8, fill=4)
    backend = remote_backends(redis_server.url)
    hashes = new_hashes(4)
    assert backend.put(refs(hashes, range(4)), pool.array) == 4
    raw = _raw(redis_server)
    raw.setrange(backend.key(hashes[2]), offset, b"\xde\xad\xbe\xef")
    assert backend.get(hashes, [4, 5, 6, 7], pool.array) == 2, what
    assert raw.exists(backend.key(hashes[2])) == 0
    assert raw.exists(backend.key(hashes[3])) == 1  # good pages after it stay
    assert backend.stats().corrupt_detected == 1
    # The connection stayed in sync: the next call reads cleanly.
    assert backend.get(hashes[:2], [4, 5], pool.array) == 2


@pytest.mark.parametrize("damage", ["truncated", "other_namespace", "not_a_string", "garbage"])
def test_foreign_or_damaged_values_are_misses(
    redis_server: RedisServer,
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
    damage: str,
) -> None:
    pool = make_pool(4, fill=2)
    ours = remote_backends(redis_server.url)
    other = remote_backends(redis_server.url, namespace=b"other")
    hashes = new_hashes(2)
    assert ours.put(refs(hashes, range(2)), pool.array) == 2
    assert other.put(refs(hashes, range(2)), pool.array) == 2
    raw = _raw(redis_server)
    key = ours.key(hashes[0])
    if damage == "truncated":
        raw.set(key, raw.getrange(key, 0, HEADER_ALIGN + 10))
    elif damage == "other_namespace":  # a well-formed page of another namespace
        raw.set(key, raw.get(other.key(hashes[0])))
    elif damage == "not_a_string":
        raw.delete(key)
        raw.rpush(key, b"x")
    else:
        raw.set(key, b"hello")
    assert ours.get(hashes, [2, 3], pool.array) == 0
    assert raw.exists(key) == 0
    assert ours.stats().corrupt_detected == 1
    assert ours.put(refs(hashes, range(2)), pool.array) == 2  # rewritten
    assert ours.get(hashes, [2, 3], pool.array) == 2


def test_ttl_expires_values_and_rewrites_renew_it(
    redis_server: RedisServer, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(4, fill=2)
    backend = remote_backends(redis_server.url, ttl_s=1)
    hashes = new_hashes(2)
    assert backend.put(refs(hashes[:1], [0]), pool.array) == 1
    raw = _raw(redis_server)
    assert 0 < raw.pttl(backend.key(hashes[0])) <= 1000
    time.sleep(0.6)
    assert backend.put(refs(hashes, [0, 1]), pool.array) == 2  # renews the first page's TTL
    assert raw.pttl(backend.key(hashes[0])) > 600
    time.sleep(1.2)
    assert backend.exists(hashes) == 0
    assert raw.dbsize() == 0
    forever = remote_backends(redis_server.url)
    assert forever.put(refs(hashes[:1], [0]), pool.array) == 1
    assert raw.ttl(forever.key(hashes[0])) == -1


def test_password_in_url(
    redis_servers: Callable[..., RedisServer],
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
) -> None:
    server = redis_servers("--requirepass", "s3cret")
    pool = make_pool(4, fill=2)
    url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
    backend = remote_backends(url)
    hashes = new_hashes(2)
    assert backend.put(refs(hashes, range(2)), pool.array) == 2
    assert backend.get(hashes, [2, 3], pool.array) == 2
    assert server.cli("-a", "s3cret", "--no-auth-warning", "-n", "3", "dbsize") == "2"
    wrong = remote_backends(f"redis://:nope@127.0.0.1:{server.port}/0", wait=False)
    assert not wrong.wait_available(0.5)
    assert wrong.exists(hashes) == 0
    assert wrong.stats().extra["probes_failed"] >= 1


def test_parse_remote_url() -> None:
    e = parse_remote_url("redis://u:p%40ss@cache.local:6380/2")
    assert (e.seed.host, e.seed.port, e.cluster) == ("cache.local", 6380, False)
    assert (e.params.username, e.params.password, e.params.db, e.params.tls) == (
        "u",
        "p@ss",
        2,
        False,
    )
    assert parse_remote_url("redis+cluster://h:7000").cluster
    assert parse_remote_url("redis://h:7000?cluster=true").cluster
    assert not parse_remote_url("redis+cluster://h:7000", cluster=False).cluster
    tls = parse_remote_url("rediss://h?ssl_cert_reqs=none")
    assert tls.params.tls and not tls.params.tls_verify and tls.seed.port == 6379
    assert parse_remote_url("valkey://h").seed.host == "h"
    with pytest.raises(ValueError, match="must start with one of"):
        parse_remote_url("http://h:6379")
    with pytest.raises(ValueError, match="unknown options"):
        parse_remote_url("redis://h?timeout=3")
    with pytest.raises(ValueError, match="database 0"):
        parse_remote_url("redis+cluster://h/2")
    with pytest.raises(ValueError, match="remote-ttl"):
        RedisConfig("redis://h", NAMESPACE, SMALL, ttl_s=0)
