"""A prefix held only in one instance's L1, only in its L2, only on its disk, only in L4 is
routed to it as vllm-router's credits say (issue 38): medium GPU at full credit, CPU at
`--kv-penalty-host`, DISK at `--kv-penalty-disk`, and L4 pages (ownership: the fleet's
pool) at `--kv-penalty-external`. Real router, real servers, a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fleet_rig import PAGE, Fleet, clear, fleet_on_redis, lookup, prompt, send, tokens

from asynchicache.bench.fleet.fleet_router import Credits, RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CREDITS = Credits(host=0.8, disk=0.3, external=0.6)  # distinct: the credit names the tier
SUFFIX = " and then one more question"
SEEDS = {"device": 101, "host": 102, "disk": 103, "remote": 104}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    flags = ("--device-cache-tokens", "2048", "--host-cache-gb", "0.2", "--disk-cache-gb", "0.4")
    root = tmp_path_factory.mktemp("media")
    with fleet_on_redis(root, flags, RouterConfig(credits=CREDITS)) as made:
        yield made


def _only_in(pair: Fleet, text: str, tier: str) -> int:
    """`text` computed on the second instance, then every tier above `tier` (and L4 when
    `tier` is disk) emptied there; the prompt tokens `tier` holds."""
    holder = pair.instances[1].url
    send(holder, text)
    order = ["device", "host", "disk", "remote"]
    drop = order[: order.index(tier)] + (["remote"] if tier == "disk" else [])
    time.sleep(3.0)  # write-through to L3/L4 runs after the reply
    if drop:
        clear(holder, *drop)
    held = lookup(holder, text)
    assert held[tier] > 0 and all(held[t] == 0 for t in order if t != tier), held
    time.sleep(1.5)  # the events reach the router
    return held[tier]


@pytest.mark.parametrize(("tier", "credit"), [("device", 1.0), ("host", CREDITS.host),
                         ("disk", CREDITS.disk), ("remote", CREDITS.external)])  # fmt: skip
def test_a_prefix_in_one_tier_is_credited_as_that_tier(
    pair: Fleet, tier: str, credit: float
) -> None:
    text = prompt(SEEDS[tier], 80)
    held = _only_in(pair, text, tier)
    full = len(tokens(pair.instances[1].url, text)) // PAGE * PAGE
    assert held >= full - PAGE
    decision, usage = pair.route(text + SUFFIX)
    assert decision.worker == pair.instances[1].url, decision
    assert abs(decision.credited - credit * held) <= PAGE, (decision, held)
    assert usage[tier] >= held - PAGE, usage  # and it was served from that tier
