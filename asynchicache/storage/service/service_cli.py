"""`asynchicache service`: the cache service as a process of its own.

asynchicache service --disk-cache-dir DIR [--address ipc://...]

Every default is written once, in settings/config.py (ServiceConfig's own: service_config.py);
the flags are service_config.py's table, each the name of the field it sets, and the names of
earlier releases (`--socket`, `--remote-ttl`, `--client-ttl`) are deprecated aliases.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from asynchicache.settings.config_flags import add_deprecated_aliases
from asynchicache.storage.service.server import run_service
from asynchicache.storage.service.service_config import (
    ServiceConfig,
    add_service_flags,
    default_address,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynchicache-cache-service",
        description="The cache service: L3 disk and L4 remote tiers for the engines of a machine.",
    )
    p.add_argument("--disk-cache-dir", type=Path, required=True)
    p.add_argument("--address", default=default_address(), help="ZeroMQ address to bind")
    add_service_flags(p, p)  # the table `serve` uses too (storage/service/service_config.py)
    p.add_argument("--no-direct-io", action="store_true", help="never use O_DIRECT")
    p.add_argument(
        "--leased-by",
        type=int,
        help="run only while engines hold leases on it; this pid (its starter) holds the "
        "first (storage.service.leases)",
    )
    p.add_argument(
        "--curve-secret-key",
        type=Path,
        help="ZeroMQ CURVE certificate of the service (a '.key_secret' file of "
        "zmq.auth.create_certificates); required with a tcp:// --address",
    )
    p.add_argument(
        "--curve-clients",
        type=Path,
        help="folder of the public '.key' files of the clients let in (with --curve-secret-key)",
    )
    p.add_argument("--log-level", default="INFO")
    add_deprecated_aliases(p)  # --socket, --remote-ttl, --client-ttl
    return p


def config_from_args(argv: list[str] | None) -> ServiceConfig:
    """The ServiceConfig these command-line flags make (no side effects)."""
    return ServiceConfig.from_flags(_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = ServiceConfig.from_flags(args)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_service(config, stop)
    return 0
