"""vLLM + our connector as fleet instances, behind vllm-router's `kv_aware`.

Each instance is `python -m vllm.entrypoints.openai.api_server` (vllm_process.py) with
`AsynchicacheConnector`, its own cache service, and the fleet's L3 folder (and L4, if
any) shared with the others. Its KV events go out through vLLM's own publisher
(`--kv-events-config`, loopback tcp, a replay socket): vLLM's blocks as medium GPU, and
what the connector hands it (integrations/vllm/kv_events.py): L2 pages as CPU, pages the
cache service stored as DISK.

What vllm-router 0.1.17 needs of such an instance (found by running it, docs/fleet.md):

* `--enable-scale-out`: the router asks the worker's `/v1/completions/render` for the
  request's token ids; vLLM 0.32 answers it 403 without the flag, and the router then
  decides with no tokens (`outcome="missing_tokens"`, nothing credited).
* One block size everywhere: vLLM's CPU attention takes multiples of 32 only, so the
  connector's page is vLLM's block (`BLOCK`) and the router's `--kv-event-block-size`.
* vLLM 0.32 binds its event socket only for a wildcard address (`tcp://*:PORT`, every
  interface; vllm-router takes tcp:// only), and connects for any other.
* vLLM publishes a step's events when it steps: after `/reset_prefix_cache` (or
  anything else done between steps) the router learns of it with the next request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asynchicache.bench.clients.pressure_client import SERVED_NAME
from asynchicache.bench.fleet.fleet_arms import (
    Arm,
    Counters,
    Fleet,
    FleetSpec,
    start_router,
    stop_fleet,
)
from asynchicache.bench.fleet.fleet_router import RouterConfig, VllmRouter, Worker
from asynchicache.bench.processes.server_process import BenchServer, free_port
from asynchicache.bench.processes.vllm_process import (
    VllmFlags,
    VllmServer,
    VllmThreads,
    machine_cores,
    metric_sum,
)
from asynchicache.common.tiers import TIERS, Tier

BLOCK = 32  # vLLM's block, our page, the router's block size (CPU attention: multiples of 32)
CONNECTOR = "AsynchicacheConnector"
CONNECTOR_HITS = "vllm:asynchicache_hit_tokens_total"
SERVE_HOST_CACHE_BYTES = 2 << 30  # serve's default L2, the vLLM arm's too


@dataclass(frozen=True)
class VllmInstanceSpec:
    """What every vLLM instance of a fleet shares."""

    model: Path
    disk: Path  # the fleet's L3 folder
    kv_cache_bytes: int = 32 << 20  # vLLM's own KV (our L1)
    host_cache_bytes: int = 64 << 20  # the connector's L2, per instance
    remote_url: str | None = None  # the fleet's L4
    dtype: str = "float32"
    max_model_len: int = 2048
    python: str = "python"  # the interpreter that has vLLM
    threads: VllmThreads | None = None  # None: vLLM's own default
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # more connector keys
    startup_timeout_s: float = 600.0
    served_name: str = "model"  # VllmServer.complete's; bench fleet's clients ask for SERVED_NAME


def vllm_flags(spec: VllmInstanceSpec, service: str, events: str, replay: str) -> VllmFlags:
    """One instance's flags: the connector on `service` (its own cache service), vLLM's
    event publisher bound on `events` and `replay` (tcp://127.0.0.1:PORT)."""
    extra: dict[str, Any] = {
        "disk_cache_dir": str(spec.disk),
        "cache_service": service,
        "host_cache_gb": spec.host_cache_bytes / 2**30,
        "page_size": BLOCK,
        **({"remote_url": spec.remote_url} if spec.remote_url else {}),
        **spec.extra_config,
    }
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM binds a wildcard (or ipc://) endpoint and connects to any other, where no
        # router listens: the wildcard binds every interface (docs/fleet.md)
        "endpoint": events.replace("127.0.0.1", "*"),
        "replay_endpoint": replay,
    }
    return VllmFlags(
        spec.model, max_model_len=spec.max_model_len, kv_cache_bytes=spec.kv_cache_bytes,
        dtype=spec.dtype, connector=CONNECTOR, extra_config=extra,
        extra=("--block-size", str(BLOCK), "--enable-scale-out",
               "--kv-events-config", json.dumps(kv_events),
               "--served-model-name", spec.served_name),
    )  # fmt: skip


def vllm_instance(spec: VllmInstanceSpec, folder: Path, name: str) -> tuple[VllmServer, Worker]:
    """An instance (not started) logging to `folder`/`name`.log, its cache service's socket
    under `folder`/`name`, and its router entry (the URL is known once it started:
    `worker_of`)."""
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    run = folder / name
    run.mkdir(parents=True, exist_ok=True)
    run.chmod(0o700)  # the cache service's socket folder must be private
    service = f"ipc://{run / 'cache.sock'}"
    env = {} if spec.threads is None else spec.threads.env()
    server = VllmServer(
        vllm_flags(spec, service, ev, rep), folder / f"{name}.log", python=spec.python,
        env=env, startup_timeout_s=spec.startup_timeout_s,
    )  # fmt: skip
    return server, Worker("", ev, rep)


def worker_of(server: VllmServer, worker: Worker) -> Worker:
    return Worker(server.url, worker.events, worker.replay)


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """What one token's KV takes in vLLM's cache for the HF model folder `model`."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    width = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * width


def vllm_counters(server: BenchServer) -> Counters:
    """An instance's totals from vLLM's /metrics: prompt tokens it computed (all less those
    cached), cached tokens by tier (vLLM's own prefix cache is our device tier; the
    connector's hits by its tier), finished requests."""
    m = server.metrics() if isinstance(server, VllmServer) else {}
    cached = {t: int(metric_sum(m, CONNECTOR_HITS, tier=t)) for t in TIERS if t != Tier.DEVICE}
    cached[Tier.DEVICE] = int(metric_sum(m, "vllm:prefix_cache_hits_total"))
    computed = metric_sum(m, "vllm:prompt_tokens_total") - metric_sum(
        m, "vllm:prompt_tokens_cached_total"
    )
    return Counters(int(computed), cached, int(metric_sum(m, "vllm:request_success_total")))


@contextlib.contextmanager
def running_vllm(
    spec: FleetSpec, arm: Arm, folder: Path, python: str, threads: VllmThreads | None
) -> Iterator[Fleet]:
    """`bench fleet`'s vLLM arm: `spec.instances` vLLM + connector instances (`spec.model`:
    an HF folder; L1 = `spec.l1_tokens` of vLLM's KV each, L3 = `folder`/kv, L4 =
    `spec.remote_url`), the router of `arm` in front, started and stopped together."""
    if spec.model is None:
        raise ValueError("the vLLM arm needs an HF model folder")
    per_token = kv_bytes_per_token(spec.model, "float32")
    longest = spec.l1_tokens // 2  # l1_per_instance keeps two of the longest prompts
    vspec = VllmInstanceSpec(
        spec.model, folder / "kv", kv_cache_bytes=spec.l1_tokens * per_token,
        host_cache_bytes=SERVE_HOST_CACHE_BYTES, remote_url=spec.remote_url,
        max_model_len=-(-longest // BLOCK) * BLOCK, python=python, threads=threads,
        startup_timeout_s=spec.startup_timeout_s, served_name=SERVED_NAME,
    )  # fmt: skip
    made = [vllm_instance(vspec, folder, f"vllm{k}") for k in range(spec.instances)]
    servers: list[BenchServer] = [s for s, _ in made]
    fleet: Fleet | None = None
    try:
        with ThreadPoolExecutor(len(made)) as pool:
            for done in [pool.submit(s.start) for s, _ in made]:
                done.result()
        workers = [worker_of(s, w) for s, w in made]
        config = RouterConfig(policy=arm.policy, block_size=BLOCK, model=str(spec.model),
                              credits=arm.credits)  # fmt: skip
        fleet = Fleet(
            servers,
            VllmRouter(config, workers, folder / "router.log"),
            workers,
            counters_of=vllm_counters,
        )
        yield start_router(fleet)
    finally:
        stop_fleet(fleet, servers)


@dataclass(frozen=True)
class VllmArm:
    """How `bench fleet` runs its vLLM arm: the interpreter that has vLLM (None: the repo's
    .venv-vllm, else this one) and vLLM's compute threads per instance (None: the cores
    over the instances, at least one)."""

    python: str | None = None
    threads: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VllmArm:
        return cls(args.vllm_python, args.vllm_threads)

    def interpreter(self) -> str:
        if self.python is not None:
            return self.python
        venv = Path(".venv-vllm/bin/python")
        return str(venv.absolute()) if venv.exists() else sys.executable

    def running(
        self, spec: FleetSpec, arm: Arm, folder: Path
    ) -> contextlib.AbstractContextManager[Fleet]:
        cores = machine_cores()
        threads = VllmThreads.of(self.threads or max(1, cores // spec.instances), cores)
        model = spec.model
        if model is None or not (model / "config.json").exists():  # a GGUF, or serve's default
            from asynchicache.tools.export_hf import export_hf

            model = export_hf(folder / "model-hf")
        return running_vllm(replace(spec, model=model), arm, folder, self.interpreter(), threads)


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", help="the vLLM arm's interpreter (default: .venv-vllm's)")
    p.add_argument("--vllm-threads", type=int, help="vLLM's compute threads per instance "
                   "(default: the cores over the instances)")  # fmt: skip
