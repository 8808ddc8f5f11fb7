"""RedisBackend against a real three-node Redis Cluster: pages spread over slots and nodes."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import redis
from pools import DEFAULT, Pool, new_hashes, refs
from redis_server import RedisClusterNodes, RedisServer
from remote_helpers import Backends


def test_cluster_stores_and_loads_across_slots(
    redis_cluster: RedisClusterNodes, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(48, DEFAULT, fill=24, seed=3)
    backend = remote_backends(redis_cluster.url, DEFAULT, batch_pages=4)
    hashes = new_hashes(24)
    assert backend.put(refs(hashes, range(24), page_tokens=16), pool.array) == 24
    # Every node holds some of the pages: keys went to the node owning their slot.
    per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes]
    assert sum(per_node) == 24 and all(c > 0 for c in per_node), per_node
    assert backend.exists(hashes) == 24
    assert backend.get(hashes, list(range(24, 48)), pool.array) == 24
    assert np.array_equal(pool.array[24:48], pool.array[0:24])
    # A corrupt page on some node is a miss there and is deleted.
    raw = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        raw.setrange(backend.key(hashes[10]), 5000, b"\x00\x01")
        assert backend.get(hashes, list(range(24, 48)), pool.array) == 10
        assert raw.exists(backend.key(hashes[10])) == 0
    finally:
        raw.close()
    assert backend.clear().removed == 23
    assert sum(redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes) == 0


def test_cluster_flag_on_a_plain_url(
    redis_cluster: RedisClusterNodes, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8, fill=4)
    port = redis_cluster.nodes[1].port
    backend = remote_backends(f"redis://127.0.0.1:{port}", cluster=True)  # another seed node
    hashes = new_hashes(4)
    assert backend.put(refs(hashes, range(4)), pool.array) == 4
    assert backend.get(hashes, [4, 5, 6, 7], pool.array) == 4
    assert backend.clear().removed == 4


def test_resharded_slots_are_followed(
    redis_cluster: RedisClusterNodes, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    """Keys moved to another node: a stale slot map costs misses (MOVED), not errors."""
    pool = make_pool(64, fill=32)
    backend = remote_backends(redis_cluster.url)
    hashes = new_hashes(32)
    assert backend.put(refs(hashes, range(32)), pool.array) == 32
    src, dst = redis_cluster.nodes[0], redis_cluster.nodes[1]
    moved = move_keys(src, dst, redis_cluster.nodes)
    assert moved > 0 and redis.Redis(port=src.port).dbsize() == 0  # all moved off node 0
    got = backend.get(hashes, list(range(32, 64)), pool.array)
    time.sleep(1.1)  # the slot map is re-read at most once a second
    assert backend.get(hashes, list(range(32, 64)), pool.array) == 32
    assert np.array_equal(pool.array[32:64], pool.array[0:32])
    stats = backend.stats()
    # A third of random keys were on node 0: the first get met MOVED (p of none: 2e-6).
    assert got < 32 and stats.extra["moved"] >= 1
    assert stats.extra["breaker_trips"] == 0
    assert backend.clear().removed == 32


def move_keys(src: RedisServer, dst: RedisServer, nodes: list[RedisServer]) -> int:
    """Reshard every slot that holds a key on `src` to `dst`, the way `redis-cli --cluster
    reshard` moves a slot (IMPORTING/MIGRATING, MIGRATE, then SETSLOT NODE everywhere), but
    only those slots: moving all 5,461 of node 0's took ~4 s. Returns the keys moved."""
    raw = {n.port: redis.Redis(port=n.port) for n in nodes}
    s, d = raw[src.port], raw[dst.port]
    ids = {n.port: raw[n.port].execute_command("CLUSTER", "MYID") for n in nodes}
    slots = {int(s.execute_command("CLUSTER", "KEYSLOT", key)) for key in s.scan_iter()}
    moved = 0
    for slot in sorted(slots):
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src.port])
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst.port])
        keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 10_000, "KEYS", *keys)
        moved += len(keys)
        for r in raw.values():
            r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst.port])
    for r in raw.values():
        r.close()
    return moved
