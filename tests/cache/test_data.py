"""KV bytes survive L1 -> L2 -> (dropped from L1) -> L1, and another process sees them in L2."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from asynchicache.common.keys import Namespace
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pools import KVLayout
from asynchicache.settings.config import CacheConfig, WritePolicy

PAGE = 8
CHILD = """
import hashlib, json, sys, torch
from asynchicache.hierarchy.pools import HostPool, KVLayout
name, dtype, slots = sys.argv[1], getattr(torch, sys.argv[2]), json.loads(sys.argv[3])
layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=8, dtype=dtype)
pool = HostPool.attach(name, layout)
# Read through both views the service and the engine use.
by_slots = [hashlib.sha256(pool.slots[s].tobytes()).hexdigest() for s in slots]
by_tensor = [
    hashlib.sha256(pool.tensor[s].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    for s in slots
]
assert by_slots == by_tensor
print(json.dumps(by_slots))
pool.close()
"""


def _digest(page: torch.Tensor) -> str:
    return hashlib.sha256(page.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def cache(request: pytest.FixtureRequest) -> Iterator[HiRadixCache]:
    dtype = request.param
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=PAGE, dtype=dtype)
    cfg = CacheConfig(
        page_size=PAGE,
        device_cache_tokens=8 * PAGE,
        host_cache_gb=8 * layout.page_bytes / 2**30,
        write_policy=WritePolicy.WRITE_THROUGH,
        disk_cache_dir=None,
    )
    ns = Namespace("data-test", str(dtype).removeprefix("torch."), PAGE)
    c = HiRadixCache(cfg, layout, ns, torch.device("cpu"))
    yield c
    c.close()


def test_kv_round_trip_through_l2_is_byte_identical(cache: HiRadixCache) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = list(range(1000, 1000 + 3 * PAGE + 5))
    pages = cache.allocate(3)
    assert pages is not None
    # [pages, layers, 2, page_size, kv_heads, head_dim]
    kv = torch.randn((3, *cache.layout.page_shape), generator=gen).to(cache.layout.dtype)
    for i, p in enumerate(pages):
        cache.device_pool.tensor[p].copy_(kv[i])
    handle = cache.insert(tokens, pages).handle
    cache.unlock(handle)
    cache.drain()
    slots = list(handle.node.host or [])
    assert len(slots) == 3

    # Another process maps the pool by name and finds the same bytes.
    dtype = str(cache.layout.dtype).removeprefix("torch.")
    assert cache.host_pool is not None
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), cache.host_pool.name, dtype, str(slots)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [_digest(kv[i]) for i in range(3)]

    # Drop from L1, overwrite the freed pages, then load back.
    assert cache.evict(3) == 3
    scratch = cache.allocate(8)
    assert scratch is not None
    cache.device_pool.tensor[scratch].fill_(-1)
    cache.free(scratch)
    match = cache.match(tokens)
    assert match.device_pages == [] and match.host_hit_pages == 3
    ticket = cache.load(match)
    assert ticket is not None
    cache.drain()
    assert ticket.ok and ticket.handle is not None
    for i, p in enumerate(ticket.device_pages):
        assert _digest(cache.device_pool.tensor[p]) == _digest(kv[i])
    cache.unlock(ticket.handle)
    cache.check_integrity()
