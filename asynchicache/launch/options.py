"""`asynchicache serve` flags (and an optional YAML config file) -> `LaunchConfig`.

This module only turns parsed flags into configuration (the flags are in `flags.py`, the
YAML file in `config_file.py`); the configs themselves, their defaults and their
validation live in `asynchicache.settings.config`. Every size flag counts GiB (2**30 bytes).
`to_config` is the one place serve's settings become its processes' configs: each
flag's dest is the name of the field it sets (tests/server/test_config_vocabulary.py).

Other servers' flags (SGLang HiCache, LightLLM, the seed's hiradix flags) are
written into ours first, with their meanings (launch/compat_flags.py, compat_resolve.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from asynchicache.launch.compat_resolve import apply_compat
from asynchicache.launch.config_file import config_file_defaults
from asynchicache.launch.flags import build_parser
from asynchicache.server.guards.exposure import is_loopback
from asynchicache.settings.config import (
    CacheConfig,
    EngineConfig,
    LaunchConfig,
    PrefetchPolicy,
    ServerConfig,
    ServiceTuning,
    WritePolicy,
)
from asynchicache.settings.config_flags import config_kwargs

log = logging.getLogger(__name__)


def _device(args: argparse.Namespace) -> str:
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_remote_url(url: str | None) -> None:
    """A malformed --remote-url fails now, not in the cache service after the model loaded."""
    if url is not None:
        from asynchicache.storage.remote.topology import parse_remote_url  # pulls in redis-py

        parse_remote_url(url)


def _check_disk_folder(folder: Path | None) -> None:
    """A folder others could write into fails now, not in the cache service later."""
    if folder is not None:
        from asynchicache.storage.disk.folder import check_disk_folder

        check_disk_folder(folder)


def _cache(args: argparse.Namespace) -> CacheConfig:
    _check_remote_url(args.remote_url)
    if not args.no_disk_cache and not args.no_prefix_cache:
        _check_disk_folder(args.disk_cache_dir.expanduser())
    return CacheConfig(
        **config_kwargs(
            CacheConfig,
            args,
            enable_host_cache=not args.no_host_cache,
            write_policy=WritePolicy(args.write_policy),
            prefetch_policy=PrefetchPolicy(args.prefetch_policy),
            enable_prefix_cache=not args.no_prefix_cache,
            disk_cache_dir=None if args.no_disk_cache else args.disk_cache_dir.expanduser(),
        )
    )


def to_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parsed flags (and, for other servers' flags, `environ`: os.environ) -> the config."""
    args, notes = apply_compat(args, build_parser(), os.environ if environ is None else environ)
    for note in notes:
        log.info("%s", note)
    server = ServerConfig(**config_kwargs(ServerConfig, args))
    engine = EngineConfig(**config_kwargs(EngineConfig, args, device=_device(args)))
    service = ServiceTuning(**config_kwargs(ServiceTuning, args))
    # The rest of LaunchConfig (storage_timeout_s, host_cache_tokens, kv_events_*): each
    # flag's dest is its field's name.
    config = LaunchConfig(
        **config_kwargs(
            LaunchConfig, args, server=server, engine=engine, cache=_cache(args), service=service
        )
    )
    if config.kv_events_endpoint is not None:  # an address others could reach fails now
        from asynchicache.kv_events.publisher import kv_events_config

        kv_events_config(config)
    return config


def exposure_warnings(server: ServerConfig) -> list[str]:
    """What `serve` warns about at start: a server others can reach with no key."""
    if is_loopback(server.host) or server.api_key is not None:
        return []
    # Without any key, clearing and pinning are refused there (server/guards/exposure.py).
    admin = "" if server.admin_api_key is not None else (
        "; clearing and pinning the cache are refused until a key is set")  # fmt: skip
    return [
        f"listening on {server.host}, beyond this machine, without --api-key: anyone who "
        f"can reach port {server.port} may generate, read the cache's stats and look up "
        f"prompts{admin}. Set --api-key (and --admin-api-key), or --host 127.0.0.1"
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """argv (and the --config file it names) -> parsed flags; the command line wins."""
    parser = build_parser()
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", type=Path)
    known, _ = first.parse_known_args(argv)
    if known.config is not None:
        try:
            parser.set_defaults(**config_file_defaults(parser, known.config))
        except ValueError as exc:
            parser.error(str(exc))
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """`asynchicache serve ...`: parse, validate, run until stopped."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = to_config(args)
    except ValueError as exc:
        build_parser().error(str(exc))
    from asynchicache.launch.launch import launch

    for warning in exposure_warnings(config.server):
        log.warning("%s", warning)
    return launch(config)
