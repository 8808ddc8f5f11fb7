"""The launcher: HTTP server in this process, engine and cache service as children.

    asynchicache: http           (this process) FastAPI + uvicorn, tokenize/detokenize
    asynchicache: engine         scheduler, model, radix tree, L1, L1<->L2 copies
    asynchicache: cache-service  L3 disk / L4 remote, reading and writing L2 pages

Start order: cache service, engine, then HTTP once the engine answers
"health". The cache service is restarted when it dies, and when it stays
silent (no answer to a `Stats` ping) for 3x `--storage-timeout`, with back-off
(0.2 s doubling to 5 s) however often: it is never fatal, the engine serves
from L1 (recomputing) meanwhile. The engine is restarted when it dies, and when
it stays silent (no answer to a "health" ping, answered between two steps) for
`--engine-step-timeout`: it is hung, and killed. Its requests in flight end with
a JSON error (an error event and `[DONE]` on a stream), new ones and `/ready`
answer 503 with the reason until the new engine answers "health"; the cache
service and what it holds (L3, L4) stay, the engine's L1 and L2 go with it (its
radix tree was their index) and its shared-memory segment is removed. Only a
crash loop of the engine stops the server.

The launcher owns SIGINT/SIGTERM: it stops accepting requests, gives the
running ones `--shutdown-timeout` to finish (then ends each with an error),
stops the engine (which hands its last stores to the service), then the cache
service (which finishes its writes), then removes the private runtime folder,
any shared-memory segment a dead child left, and temp files of killed writers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from setproctitle import setproctitle

from asynchicache.common.shm import remove_stale_segments
from asynchicache.engine.process import EngineProcessConfig, run_engine
from asynchicache.kv_events.publisher import KvEventsConfig, kv_events_config
from asynchicache.launch.allocator import allocator_env
from asynchicache.launch.engine_probe import EngineProbe
from asynchicache.launch.frontend import Frontend, load_frontend
from asynchicache.launch.openmp import openmp_env
from asynchicache.launch.supervisor import ChildSpec, Supervisor
from asynchicache.server.context import AppContext, ModelInfo
from asynchicache.server.engine_client import (
    EngineClient,
    EngineUnavailable,
    engine_input_addr,
    engine_output_addr,
)
from asynchicache.server.http import StopSignal, bind_socket, serve_http
from asynchicache.settings.config import GIB, CacheConfig, LaunchConfig, ServiceTuning
from asynchicache.storage.client.probe import ServiceProbe
from asynchicache.storage.service.server import ServiceConfig, run_service

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
ENGINE_STABLE_S = 60.0
# Each child gets at least this long to stop on SIGTERM (the engine hands its last stores
# to the cache service, which finishes its writes) before SIGKILL.
CHILD_STOP_S = 15.0


def make_run_dir() -> Path:
    """A private (0700) folder for the IPC sockets of this server instance."""
    base = Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="asynchicache-", dir=base))


def sized_cache(config: LaunchConfig, frontend: Frontend) -> CacheConfig:
    """The cache config with the host tier sized from a token count, when one was given.

    The count is rounded up to whole pages; GiB are powers of two, so the pool
    turns the size back into exactly that many pages.
    """
    if config.host_cache_tokens is None:
        return config.cache
    ps = config.cache.page_size
    pages = -(-config.host_cache_tokens // ps)
    page_bytes = ps * frontend.kv_bytes_per_token(config.engine.dtype)
    gib = pages * page_bytes / GIB
    return replace(config.cache, host_cache_gb=gib, enable_host_cache=True)


@dataclass(frozen=True)
class ServiceLaunch:
    """What the cache service child needs (crosses the process boundary at spawn)."""

    config: ServiceConfig
    log_level: str

    @property
    def addr(self) -> str:
        return self.config.address


def run_cache_service(launch: ServiceLaunch) -> None:
    """Cache service child: SIGTERM/SIGINT stop it cleanly (writes finish, files stay whole)."""
    logging.basicConfig(
        level=launch.log_level.upper(),
        format="%(asctime)s cache-service %(levelname)s %(name)s: %(message)s",
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    run_service(launch.config, stop)


# A cache service silent this many storage timeouts is restarted: by then every ticket
# sent to it has timed out, and its exit settles what the engine keeps quarantined.
SILENT_TIMEOUTS = 3


def _service_spec(
    cache: CacheConfig,
    tuning: ServiceTuning,
    run_dir: Path,
    log_level: str,
    storage_timeout_s: float,
) -> ChildSpec | None:
    """The cache service child (restarted if it crashes or stays silent), when the disk
    tier is on."""
    if not cache.disk_enabled or cache.disk_cache_dir is None:
        return None
    config = ServiceConfig.from_configs(cache, tuning, f"ipc://{run_dir / 'cache-service'}")
    return ChildSpec(
        "cache-service",
        run_cache_service,
        ServiceLaunch(config, log_level),
        restart=True,
        max_restarts=None,  # never fatal: without it the engine recomputes
        probe=partial(ServiceProbe, config.address),
        silent_limit_s=SILENT_TIMEOUTS * storage_timeout_s,
    )


def _engine_spec(
    config: LaunchConfig,
    cache: CacheConfig,
    run_dir: Path,
    storage_addr: str | None,
    client: EngineClient,
) -> ChildSpec:
    proc_config = EngineProcessConfig(
        engine=config.engine,
        cache=cache,
        input_addr=engine_input_addr(run_dir),
        output_addr=engine_output_addr(run_dir),
        storage_addr=storage_addr,
        storage_timeout_s=config.storage_timeout_s,
        log_level=config.server.log_level,
        kv_events=_kv_events(config),
    )
    # A crash within a minute of its start counts toward the crash loop that ends the
    # server: loading the model alone takes a good part of that. The watchdog's ping
    # (launch/engine_probe.py) finds a hung engine: silent past --engine-step-timeout.
    return ChildSpec(
        "engine",
        run_engine,
        proc_config,
        restart=True,
        stable_s=ENGINE_STABLE_S,
        probe=partial(EngineProbe, client),
        silent_limit_s=config.server.engine_step_timeout_s,
        startup_limit_s=config.server.startup_timeout_s,
        env=openmp_env(os.environ) + allocator_env(os.environ),
    )


def _kv_events(config: LaunchConfig) -> KvEventsConfig | None:
    return kv_events_config(config)


async def _watch(
    supervisor: Supervisor, stop: StopSignal, client: EngineClient, startup_timeout_s: float
) -> None:
    """Restart children that die; end the server when one may not be restarted (or a
    crash loop used up its restarts)."""
    engine = supervisor.children["engine"]
    revive: asyncio.Task[None] | None = None
    while not stop.event.is_set():
        if not engine.alive and client.down is None:
            log.error("the engine (pid %s) died (exit code %s); restarting it",
                      engine.process.pid if engine.process else "?", engine.exitcode)  # fmt: skip
            await client.engine_lost("the engine process died; it is being restarted")
        hung = engine.silent_kills
        dead = supervisor.check()  # kills a hung engine (restarted on a later turn)
        if engine.silent_kills > hung and client.down is None:
            await client.engine_lost(
                f"the engine did not answer for {engine.spec.silent_limit_s:g}s (a step "
                "past --engine-step-timeout-s, or hung); it was killed and is being restarted"
            )
        if dead is not None:
            log.error(
                "%s died (exit code %s); shutting down", dead, supervisor.children[dead].exitcode
            )
            client.fail_all(f"the {dead} process died")
            stop.set(f"{dead} died", exit_code=1)
            return
        if client.down is not None and engine.alive and revive is None:
            revive = asyncio.create_task(_revive(client, stop, startup_timeout_s))
        if revive is not None and revive.done():
            revive = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.event.wait(), WATCH_INTERVAL_S)
    if revive is not None:
        revive.cancel()


async def _revive(client: EngineClient, stop: StopSignal, timeout_s: float) -> None:
    """Serve again once the restarted engine answers "health"."""
    try:
        await client.wait_healthy(timeout_s)
    except EngineUnavailable as exc:
        stop.set(f"the restarted engine did not start: {exc}", exit_code=1)
        return
    remove_stale_segments()  # the dead engine's L2 pool
    client.engine_back()
    log.info("the engine is back; serving again")


async def _wait_healthy(client: EngineClient, stop: StopSignal, timeout_s: float) -> dict | None:
    health = asyncio.create_task(client.wait_healthy(timeout_s))
    waiter = asyncio.create_task(stop.event.wait())
    await asyncio.wait({health, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not health.done():
        health.cancel()
        return None
    try:
        return health.result()
    except EngineUnavailable as exc:
        stop.set(f"the engine did not start: {exc}", exit_code=1)
        return None


def ready_message(sock: socket.socket, model: str, with_key: bool) -> str:
    """The line printed once the server answers, with a request to paste into a shell."""
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    body = '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    auth = ' -H "Authorization: Bearer $ASYNCHICACHE_API_KEY"' if with_key else ""
    return (
        f"asynchicache ready on {url} (model {model}); try:\n"
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'"
    )


def _install_signals(stop: StopSignal) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set, f"signal {signal.Signals(sig).name}")


async def _serve(config: LaunchConfig, sock: socket.socket, run_dir: Path, sup: Supervisor) -> int:
    stop = StopSignal(asyncio.Event())
    _install_signals(stop)
    try:
        frontend = await asyncio.to_thread(load_frontend, config.engine.model)
    except (OSError, ValueError) as exc:
        log.error("cannot load the model's tokenizer and config: %s", exc)
        return 2
    cache = sized_cache(config, frontend)
    service = _service_spec(
        cache, config.service, run_dir, config.server.log_level, config.storage_timeout_s
    )
    if service is not None:
        sup.start(service)
    client = EngineClient.for_run_dir(run_dir, config.server.request_timeout_s)
    await client.start()  # connects whenever the engine binds
    storage_addr = None if service is None else service.arg.addr
    sup.start(_engine_spec(config, cache, run_dir, storage_addr, client))
    probe = ServiceProbe(service.arg.addr) if service is not None else None  # for /ready
    watcher = asyncio.create_task(_watch(sup, stop, client, config.server.startup_timeout_s))
    try:
        health = await _wait_healthy(client, stop, config.server.startup_timeout_s)
        if health is not None:
            max_model_len = frontend.max_model_len(config.engine.max_model_len)
            ctx = AppContext(
                client=client,
                tokenizer=frontend.bounded_tokenizer(max_model_len),  # refuses 8 MiB untokenized
                model=ModelInfo(
                    name=config.server.served_model_name or str(health.get("model", "model")),
                    max_model_len=max_model_len,
                    vocab_size=frontend.config.vocab_size,
                    created=int(time.time()),
                    page_size=cache.page_size,
                ),
                api_key=config.server.api_key,
                admin_api_key=config.server.admin_api_key,
                service_probe=probe,
                max_request_tokens=config.server.max_request_tokens,
            )
            # Printed, not logged: it is for the person who ran the command, at any log level.
            print(
                ready_message(sock, ctx.model.name, config.server.api_key is not None), flush=True
            )
            await serve_http(ctx, config.server, sock, stop)
    finally:
        stop.set("shutting down")
        watcher.cancel()
        await client.close()
        if probe is not None:
            probe.close()
    log.info("stopping: %s", stop.reason)
    return stop.exit_code


def _remove_temp_files(disk_dir: Path | None, pids: list[int]) -> None:
    """Temp files of writers that were killed mid-write (named `.tmp-<page>-<pid>-<rand>`)."""
    if disk_dir is None or not disk_dir.is_dir():
        return
    wanted = {str(pid) for pid in pids}
    for path in disk_dir.rglob(".tmp-*"):
        parts = path.name.rsplit("-", 2)
        if len(parts) == 3 and parts[1] in wanted:
            path.unlink(missing_ok=True)
            log.info("removed the half-written %s of a stopped writer", path)


def launch(config: LaunchConfig) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit code."""
    setproctitle("asynchicache: http")
    sock = bind_socket(config.server.host, config.server.port)
    run_dir = make_run_dir()
    remove_stale_segments()
    sup = Supervisor()
    try:
        return asyncio.run(_serve(config, sock, run_dir, sup))
    finally:
        # Cleanup is bounded (SIGKILL after the timeout); a second Ctrl-C must not cut it short.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        pids = sup.stop_all(max(config.server.shutdown_timeout_s, CHILD_STOP_S))
        sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        remove_stale_segments()
        _remove_temp_files(config.cache.disk_cache_dir, pids)
        log.info("stopped")
