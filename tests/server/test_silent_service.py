"""A cache service alive but silent (SIGSTOP) is restarted, which settles the engine's
quarantine; and `--storage-timeout` sets the timeout that all of this hangs on."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from asynchicache.common.shm import SharedSegment
from asynchicache.launch.launch import (
    SILENT_TIMEOUTS,
    ServiceLaunch,
    _engine_spec,
    _service_spec,
    run_cache_service,
)
from asynchicache.launch.options import build_parser, to_config
from asynchicache.launch.supervisor import ChildSpec, Supervisor
from asynchicache.server.engine_client import EngineClient
from asynchicache.storage.base import PageLayout
from asynchicache.storage.client.probe import ServiceProbe
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient
from asynchicache.storage.service.server import ServiceConfig

LAYOUT = PageLayout("float32", (2, 2, 4, 2, 8))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="acq-"))  # ipc:// paths are limited to ~107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _check_until(sup: Supervisor, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        assert sup.check() is None  # the cache service is restartable: never fatal
        time.sleep(0.1)


def test_a_silent_service_is_restarted_and_its_quarantine_settles(
    tmp_path: Path, sock_dir: Path
) -> None:
    addr = f"ipc://{sock_dir}/cache.sock"
    config = ServiceConfig(tmp_path / "kv", addr)
    spec = ChildSpec(
        "cache-service",
        run_cache_service,
        ServiceLaunch(config, "WARNING"),
        restart=True,
        probe=partial(ServiceProbe, addr),
        silent_limit_s=1.0,
    )
    sup = Supervisor()
    child = sup.start(spec)
    segment = SharedSegment.create(8 * LAYOUT.page_bytes, tag="test")
    client = StorageClient(ClientConfig(addr, b"ns", segment.name, LAYOUT, ticket_timeout_s=0.3))
    try:
        _check_until(sup, lambda: child.probe is not None and child.probe.answered)
        assert client.wait_ready(30)
        first = child.process.pid  # type: ignore[union-attr]
        os.kill(first, signal.SIGSTOP)
        ticket = client.submit_load([os.urandom(16)], [0])
        [done] = client.wait([ticket], 10)
        assert (done.error, done.settled) == ("timed out", False)
        assert client.quarantined == 1
        _check_until(sup, lambda: child.process.pid != first and child.alive)  # type: ignore[union-attr]
        assert child.silent_kills == 1 and child.restarts == 1
        [settled] = client.wait_settled([ticket], 10)
        assert settled.reason == "service exited" and client.quarantined == 0
        # The new service serves the same client once it reconnected.
        assert client.wait_ready(60)
        [again] = client.wait([client.submit_load([os.urandom(16)], [1])], 10)
        assert again.settled and again.error == "1 of 1 pages missed"
        for _ in range(5):  # answering: never killed again
            assert sup.check() is None
            time.sleep(0.2)
        assert child.silent_kills == 1
    finally:
        client.close()
        sup.stop_all(timeout_s=10)
        segment.close()


def test_storage_timeout_flag(tmp_path: Path) -> None:
    parser = build_parser()
    assert "--storage-timeout" in parser.format_help()
    argv = ["--storage-timeout", "0.5", "--device", "cpu", "--disk-cache-dir", str(tmp_path)]
    config = to_config(parser.parse_args(argv))
    assert config.storage_timeout_s == 0.5
    # The engine's tickets use it; the cache service is restarted after 3x of it in silence.
    client = EngineClient.for_run_dir(tmp_path)
    engine = _engine_spec(config, config.cache, tmp_path, "ipc://x", client)
    asyncio.run(client.close())
    assert engine.arg.storage_timeout_s == 0.5
    # The engine's watchdog (issue 39): silent past --engine-step-timeout, it is hung.
    assert engine.probe is not None and engine.silent_limit_s == 60.0
    assert engine.startup_limit_s == config.server.startup_timeout_s
    service = _service_spec(
        config.cache, config.service, tmp_path, "info", config.storage_timeout_s
    )
    assert service is not None and service.silent_limit_s == 1.5 and service.probe is not None
    assert to_config(parser.parse_args(["--device", "cpu"])).storage_timeout_s == 10.0
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="--storage-timeout"):
            to_config(parser.parse_args(["--storage-timeout", bad, "--device", "cpu"]))
    for bad in ("nan", "inf"):  # refused by the flag's type itself (exit 2, naming it)
        with pytest.raises(SystemExit):
            parser.parse_args(["--storage-timeout", bad, "--device", "cpu"])
    assert SILENT_TIMEOUTS == 3
