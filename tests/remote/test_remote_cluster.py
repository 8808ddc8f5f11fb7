"""RedisBackend against a real three-node Redis Cluster: pages spread over slots and nodes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import redis
from remote_helpers import DEFAULT, Backends, Pool, RedisClusterNodes, new_hashes, refs


def test_cluster_stores_and_loads_across_slots(
    redis_cluster: RedisClusterNodes, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(48, DEFAULT)
    pool.fill(range(24), seed=3)
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
    assert backend.clear() == 23
    assert sum(redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes) == 0


def test_cluster_flag_on_a_plain_url(
    redis_cluster: RedisClusterNodes, remote_backends: Backends, make_pool: Callable[..., Pool]
) -> None:
    pool = make_pool(8)
    pool.fill(range(4))
    port = redis_cluster.nodes[1].port
    backend = remote_backends(f"redis://127.0.0.1:{port}", cluster=True)  # another seed node
    hashes = new_hashes(4)
    assert backend.put(refs(hashes, range(4)), pool.array) == 4
    assert backend.get(hashes, [4, 5, 6, 7], pool.array) == 4
    assert backend.clear() == 4
