"""vLLM + our connector as the fleet's instances, behind a real vllm-router `kv_aware` fed
by vLLM's own event publisher (issue 38): a prefix held by one instance in its device
tier (vLLM's blocks, medium GPU) is routed to it at full credit; one held there only in
the fleet's shared L3 (the connector's DISK pages) at `--kv-penalty-disk`, or, where the
instance declares the folder shared (the connector's `kv_events_shared_disk`), as the
fleet's pool's (`ownership`) at `--kv-penalty-external`.

Two vLLM processes (.venv-vllm, the tiny random Llama), one L3 folder between them,
each its own cache service, the second declaring it shared; bench/fleet/fleet_vllm.py makes
their flags (the same as `bench fleet`'s vLLM arm)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from fleet_rig import prompt
from tiny_llama import tiny_llama

from asynchicache.bench.fleet.fleet_router import Credits, Decision, RouterConfig, VllmRouter
from asynchicache.bench.fleet.fleet_vllm import BLOCK, VllmInstanceSpec, vllm_instance, worker_of
from asynchicache.bench.processes.vllm_process import VllmServer, VllmThreads, metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CREDITS = Credits(host=0.8, disk=0.3, external=0.6)
VLLM_PYTHON = Path(
    os.environ.get("VLLM_PYTHON", Path(__file__).parents[2] / ".venv-vllm" / "bin" / "python")
)
LEAD = 3  # blocks of an L3 prefix the other instance computes itself
SHARED_L3 = {"kv_events_shared_disk": True}  # the connector's key (serve's flag)
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 32 * 4  # tokens x layers x K/V x kv heads x head_dim x fp32


@dataclass
class VllmFleet:
    servers: list[VllmServer]
    router: VllmRouter

    def route(self, text: str) -> Decision:
        seen = len(self.router.decisions())
        body = {"model": "model", "prompt": text, "max_tokens": 1, "temperature": 0}
        httpx.post(self.router.url + "/v1/completions", json=body, timeout=300).raise_for_status()
        deadline = time.monotonic() + 10
        while len(decisions := self.router.decisions()) <= seen:
            assert time.monotonic() < deadline, "the router logged no decision"
            time.sleep(0.05)
        return decisions[seen]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (make install-vllm)")
    root = tmp_path_factory.mktemp("vllm-fleet")
    from asynchicache.tools.export_hf import export_hf

    model = tiny_llama(root / "model", export_hf(root / "smollm2-hf"))
    spec = VllmInstanceSpec(
        model, root / "kv", kv_cache_bytes=96 * BLOCK_BYTES, host_cache_bytes=48 * BLOCK_BYTES,
        max_model_len=1024, python=str(VLLM_PYTHON), threads=VllmThreads.of(1),
        # a loaded test machine must not turn hits into misses; a tiny model recomputes
        # faster than most loads pay
        extra_config={"lookup_timeout_s": 5.0, "load_policy": "always"},
    )  # fmt: skip
    # The second declares the folder the fleet's: its stored pages go out as the pool's.
    specs = [spec, replace(spec, extra_config={**spec.extra_config, **SHARED_L3})]
    made = [vllm_instance(s, root, f"vllm{k}") for k, s in enumerate(specs)]
    servers = [s for s, _ in made]
    router = None
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        workers = [worker_of(s, w) for s, w in made]
        config = RouterConfig(block_size=BLOCK, model=str(model), credits=CREDITS)
        router = VllmRouter(config, workers, root / "router.log")
        router.start()
        time.sleep(1.5)  # its subscriptions take hold (a SUB misses what came before)
        yield VllmFleet(servers, router)
    finally:
        if router is not None:
            router.stop()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.stop(), servers))


def _stored(server: VllmServer) -> float:
    """Pages the connector's cache service stored so far. Its stats reach /metrics when
    vLLM steps: a request shorter than a page makes it step first."""
    server.complete([1, 2, 3], max_tokens=1)
    return metric_sum(server.metrics(), "vllm:asynchicache_events_total", event="pages_stored")


def _held(server: VllmServer, text: str) -> int:
    """`text` computed on `server`; the prompt tokens its whole blocks cover."""
    return server.complete(text, max_tokens=1)["usage"]["prompt_tokens"] // BLOCK * BLOCK


def test_a_prefix_in_one_instances_device_tier_is_routed_to_it_at_full_credit(
    pair: VllmFleet,
) -> None:
    holder = pair.servers[1]
    text = prompt(201, 80)
    held = _held(holder, text)
    time.sleep(2.0)  # its events reach the router
    decision = pair.route(text + " and then one more question")
    assert decision.worker == holder.url, decision
    assert decision.credited == held, (decision, held)


def _only_in_l3(holder: VllmServer, text: str) -> int:
    """`text` computed on `holder`, stored by its cache service (DISK events), then pushed
    out of vLLM's 96 blocks and the connector's 48-page L2; the tokens L3 holds."""
    before = _stored(holder)
    held = _held(holder, text)
    deadline = time.monotonic() + 60
    while _stored(holder) - before < held // BLOCK:  # the service stored them: DISK events
        assert time.monotonic() < deadline, "the cache service never stored the prompt"
        time.sleep(0.5)
    for seed in range(210, 218):
        holder.complete(prompt(seed, 100), max_tokens=1)
    holder.complete([1, 2, 3], max_tokens=1)  # vLLM publishes a step's events as it steps
    time.sleep(1.0)
    return held


def _lead_on_device(server: VllmServer, text: str) -> None:
    """`text`'s first LEAD blocks computed on `server` (its device tier holds them)."""
    body = {"model": "model", "prompt": text}
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    server.complete(ids[: LEAD * BLOCK + 5], max_tokens=1)


def _route_past_a_lead(pair: VllmFleet, holder: int, seed: int) -> tuple[Decision, int, str]:
    """A prefix only in the shared L3, stored by `holder`; the other instance holds its
    first LEAD blocks on device. The router's decision, the tokens in L3, the other's URL."""
    text = prompt(seed, 80)
    held = _only_in_l3(pair.servers[holder], text)
    other = pair.servers[1 - holder]
    _lead_on_device(other, text)
    time.sleep(1.0)  # its events reach the router
    return pair.route(text + " and then one more question"), held, other.url


def test_a_prefix_only_in_the_shared_l3_is_routed_at_the_disk_credit(pair: VllmFleet) -> None:
    """Without kv_events_shared_disk: the instance that stored it, at `--kv-penalty-disk`
    (above the other's few device blocks)."""
    decision, held, _ = _route_past_a_lead(pair, 0, 202)
    assert CREDITS.disk * held > LEAD * BLOCK  # the holder wins on its L3 pages alone
    assert decision.worker == pair.servers[0].url, decision
    assert abs(decision.credited - CREDITS.disk * held) <= BLOCK, (decision, held)


def test_a_prefix_in_a_declared_shared_l3_is_announced_as_the_pools(pair: VllmFleet) -> None:
    """kv_events_shared_disk: the L3 pages go out with `ownership` (the pool), which
    vllm-router 0.1.17 credits at `--kv-penalty-external`, and to the instance that
    announced them only: the other instance, with the prefix's first LEAD blocks on
    device, would win if the pool's blocks counted for it too (docs/fleet.md)."""
    decision, held, _ = _route_past_a_lead(pair, 1, 203)
    holder = pair.servers[1].url
    assert decision.worker == holder, (decision, "the pool's blocks credited to the other?")
    assert abs(decision.credited - CREDITS.external * held) <= BLOCK, (decision, held)
