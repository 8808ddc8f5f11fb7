"""`python -m asynchicache.storage.service`: the cache service as a process of its own.

python -m asynchicache.storage.service --disk-cache-dir DIR [--socket ipc://...]

Every default is `ServiceConfig`'s (written once, there).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from asynchicache.config import GIB
from asynchicache.config_flags import add_config_flags, finite_float
from asynchicache.storage.disk_write import SyncMode
from asynchicache.storage.service import run_service
from asynchicache.storage.service_config import ServiceConfig, default_address
from asynchicache.storage.tiered import RemoteTierConfig


def _parser() -> argparse.ArgumentParser:
    d = ServiceConfig  # the defaults
    p = argparse.ArgumentParser(
        prog="asynchicache-cache-service",
        description="The cache service: L3 disk and L4 remote tiers for the engines of a machine.",
    )
    p.add_argument("--disk-cache-dir", type=Path, required=True)
    p.add_argument("--socket", default=default_address(), help="ZeroMQ address to bind")
    p.add_argument(
        "--disk-cache-gb",
        type=finite_float,
        default=d.capacity_bytes / GIB,
        help="L3 capacity in GiB (2**30 bytes)",
    )
    add_config_flags(p, d, {
        "--io-threads": "parallel file I/O per namespace",
        "--workers": "requests served at once",
        "--client-ttl": "forget silent clients (s)",
        "--max-pinned-fraction": "the share of --disk-cache-gb pins may hold (a pin over it "
        "is refused)",
    })  # fmt: skip
    p.add_argument(
        "--disk-sync",
        choices=[m.value for m in SyncMode],
        default=d.sync.value,
        help="durability of stored pages: one syncfs per put, fdatasync per file, or none",
    )
    p.add_argument("--no-direct-io", action="store_true", help="never use O_DIRECT")
    p.add_argument("--remote-url", help="L4 Redis/Valkey, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--remote-ttl", type=int, help="L4 value expiry in seconds (default: none)")
    p.add_argument(
        "--leased-by",
        type=int,
        help="run only while engines hold leases on it; this pid (its starter) holds the "
        "first (storage.service_leases)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(argv: list[str] | None) -> ServiceConfig:
    """The ServiceConfig these command-line flags make (no side effects)."""
    return _config(_parser().parse_args(argv))


def _config(a: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        a.disk_cache_dir,
        a.socket,
        int(a.disk_cache_gb * GIB),
        a.io_threads,
        a.workers,
        sync=SyncMode(a.disk_sync),
        direct_io=not a.no_direct_io,
        client_ttl_s=a.client_ttl,
        remote=RemoteTierConfig(a.remote_url, a.remote_ttl) if a.remote_url else None,
        max_pinned_fraction=a.max_pinned_fraction,
        leased_by=a.leased_by,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = _config(args)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_service(config, stop)
    return 0
