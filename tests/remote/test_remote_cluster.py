"""RedisBackend against a real three-node Redis Cluster: pages spread over slots and nodes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import numpy as np
import redis
from pools import DEFAULT, Pool, new_hashes, refs
from redis_server import RedisClusterNodes
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
    ids = [n.cli("cluster", "myid") for n in (src, dst)]
    argv = ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{src.port}"]
    argv += ["--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots", "5461"]
    subprocess.run([*argv, "--cluster-yes"], check=True, capture_output=True, timeout=120)
    assert redis.Redis(port=src.port).dbsize() == 0  # everything moved off node 0
    got = backend.get(hashes, list(range(32, 64)), pool.array)
    time.sleep(1.1)  # the slot map is re-read at most once a second
    assert backend.get(hashes, list(range(32, 64)), pool.array) == 32
    assert np.array_equal(pool.array[32:64], pool.array[0:32])
    stats = backend.stats()
    # A third of random keys were on node 0: the first get met MOVED (p of none: 2e-6).
    assert got < 32 and stats.extra["moved"] >= 1
    assert stats.extra["breaker_trips"] == 0
    assert backend.clear().removed == 32
