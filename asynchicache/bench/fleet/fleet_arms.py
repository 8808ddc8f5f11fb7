"""One arm of `bench fleet`: N of our servers sharing L3 and L4, vllm-router in front.

`FleetSpec` says what every arm shares (the model, L1 per instance, the shared disk
folder's parent, the Valkey Cluster's URL, extra serve flags); `Arm` what differs
(vllm-router's policy, its credits). `running(spec, arm, folder)` starts the
instances together (each with its KV events and replay sockets on loopback tcp,
`--kv-events-shared-disk`: the folder is the fleet's), then the router, and stops
everything on the way out. `Counters` are what the instances say they did
(computed prompt tokens, cached tokens by tier, finished requests), read before and
after a run so that warm-ups and measurements do not count.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from asynchicache.bench.clients.pressure_client import SERVED_NAME
from asynchicache.bench.fleet.fleet_router import Credits, RouterConfig, VllmRouter, Worker
from asynchicache.bench.processes.server_process import BenchServer, free_port
from asynchicache.bench.processes.vllm_process import machine_cores, metric_sum
from asynchicache.common.tiers import TIERS

log = logging.getLogger(__name__)

SUBSCRIBE_S = 1.0  # the router's SUB sockets take hold (a SUB misses what came before)


@dataclass(frozen=True)
class Arm:
    """A router in front of the fleet: its policy and, for kv_aware, its credits."""

    name: str
    policy: str
    credits: Credits | None = None  # None: vllm-router's defaults
    engine: str = "ours"  # the instances: "ours" (asynchicache serve) or "vllm" (+ connector)


@dataclass(frozen=True)
class FleetSpec:
    instances: int
    l1_tokens: int  # --device-cache-tokens of each instance
    remote_url: str  # the Valkey Cluster
    model: Path | None = None  # None: serve's default model
    serve_args: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0


@dataclass(frozen=True)
class Counters:
    """One instance's totals at a moment."""

    computed_prompt_tokens: int
    cached_by_tier: Mapping[str, int]
    requests: int

    def minus(self, before: Counters) -> Counters:
        return Counters(
            self.computed_prompt_tokens - before.computed_prompt_tokens,
            {t: n - before.cached_by_tier.get(t, 0) for t, n in self.cached_by_tier.items()},
            self.requests - before.requests,
        )


@dataclass
class Fleet:
    servers: list[BenchServer]
    router: VllmRouter
    workers: list[Worker] = field(default_factory=list)
    counters_of: Callable[[BenchServer], Counters] = field(default=lambda s: _counters(s))

    def counters(self) -> list[Counters]:
        return [self.counters_of(s) for s in self.servers]


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def _counters(server: BenchServer) -> Counters:
    stats = server.get_json("/cache/stats")
    metrics = _metrics(server.url)
    cached = {
        t: int(metric_sum(metrics, "asynchicache_cached_prompt_tokens_total", tier=t))
        for t in TIERS
    }
    requests = int(metric_sum(metrics, "vllm:request_success_total"))
    return Counters(int(stats.get("computed_prompt_tokens") or 0), cached, requests)


def threads_per_instance(instances: int) -> int:
    """The engine threads each instance gets unless told (`--serve-arg=--threads`): the
    cores over the instances (at least one), so that N engines do not each spin as many
    threads as the host has cores."""
    return max(1, machine_cores() // instances)


def _serve_flags(spec: FleetSpec, disk: Path, events: str, replay: str) -> list[str]:
    model = [] if spec.model is None else ["--model", str(spec.model)]
    if not any(a == "--threads" or a.startswith("--threads=") for a in spec.serve_args):
        model += ["--threads", str(threads_per_instance(spec.instances))]
    return [*model, "--served-model-name", SERVED_NAME,
            "--device-cache-tokens", str(spec.l1_tokens),
            "--disk-cache-dir", str(disk), "--kv-events-shared-disk",
            "--remote-url", spec.remote_url,
            "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay,
            "--kv-events-plaintext", *spec.serve_args]  # fmt: skip


def _start_servers(servers: Sequence[BenchServer]) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        for done in [pool.submit(s.start) for s in servers]:
            done.result()


def clear_all(fleet: Fleet) -> None:
    """Every tier of every instance emptied (L3 and L4 are shared: the first clears them)."""
    for s in fleet.servers:
        scope = ["device", "host", "disk", "remote"]
        r = s.http.post(s.url + "/cache/clear", json={"scope": scope}, timeout=600)
        r.raise_for_status()


@contextlib.contextmanager
def running(spec: FleetSpec, arm: Arm, folder: Path) -> Iterator[Fleet]:
    """The instances (sharing `folder`/kv) and the router of `arm`, started together."""
    disk = folder / "kv"
    disk.mkdir(parents=True, exist_ok=True)
    servers, workers = [], []
    for k in range(spec.instances):
        ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        flags = _serve_flags(spec, disk, ev, rep)
        servers.append(BenchServer(flags, folder / f"server{k}.log", spec.startup_timeout_s))
        workers.append(Worker("", ev, rep))
    fleet: Fleet | None = None
    try:
        _start_servers(servers)
        workers = [Worker(s.url, w.events, w.replay) for s, w in zip(servers, workers, strict=True)]
        config = RouterConfig(policy=arm.policy, credits=arm.credits)
        fleet = Fleet(servers, VllmRouter(config, workers, folder / "router.log"), workers)
        yield start_router(fleet)
    finally:
        stop_fleet(fleet, servers)


def start_router(fleet: Fleet) -> Fleet:
    """The fleet's router started, its SUB sockets given time to take hold."""
    fleet.router.start()
    time.sleep(SUBSCRIBE_S)
    return fleet


def stop_fleet(fleet: Fleet | None, servers: Sequence[BenchServer]) -> None:
    """The router in front now (an arm may have restarted it), then every instance."""
    if fleet is not None:
        fleet.router.stop()
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.stop(), servers))
