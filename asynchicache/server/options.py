"""`asynchicache serve` flags -> `LaunchConfig` (Server/Engine/Cache configs).

Flags follow the config fields' names. The seed's flags are accepted as aliases:

    --use_hiradix_cache           enable the host tier (L2); it is on by default here
    --hiradix_cache_gpu           keep the first cache level (L1) on the GPU: --device cuda
    --hiradix_cache_token_num N   host tier (L2) capacity in tokens, instead of --host-cache-gb
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from asynchicache.config import (
    CacheConfig,
    EngineConfig,
    PrefetchPolicy,
    ServerConfig,
    WritePolicy,
    default_disk_cache_dir,
)

API_KEY_ENV = "ASYNCHICACHE_API_KEY"


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `asynchicache serve` was asked for."""

    server: ServerConfig
    engine: EngineConfig
    cache: CacheConfig
    # The seed's --hiradix_cache_token_num: the host tier's size in tokens,
    # turned into bytes once the model's KV size per token is known.
    host_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.cache.remote_url is not None and not self.cache.disk_enabled:
            raise ValueError(
                "--remote-url needs the disk tier (drop --no-disk-cache/--no-prefix-cache): "
                "the cache service keeps L4 behind L3"
            )
        if self.host_cache_tokens is not None and self.host_cache_tokens <= 0:
            raise ValueError(
                f"--hiradix_cache_token_num must be positive, got {self.host_cache_tokens}"
            )


def _add_server(p: argparse.ArgumentParser) -> None:
    s = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=s.host, help="address to listen on (default %(default)s)")
    g.add_argument(
        "--port", type=int, default=s.port, help="port to listen on (default %(default)s)"
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on all but /health (or ${API_KEY_ENV})",
    )
    g.add_argument("--served-model-name", help="model id clients send (default: the model's name)")
    g.add_argument(
        "--log-level",
        default=s.log_level,
        choices=["debug", "info", "warning", "error", "critical"],
        help="log verbosity",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=s.startup_timeout_s,
        help="seconds to wait for the engine to load the model (default %(default)s)",
    )


def _add_engine(p: argparse.ArgumentParser) -> None:
    e = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)"
    )
    g.add_argument(
        "--dtype",
        default=e.dtype,
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV dtype (default %(default)s)",
    )
    g.add_argument(
        "--max-running-requests",
        type=int,
        default=e.max_running_requests,
        help="requests decoded together (default %(default)s)",
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=e.chunked_prefill_size,
        help="prompt tokens of one request prefilled per step (default %(default)s)",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=e.max_prefill_tokens,
        help="prompt tokens of all requests prefilled per step (default %(default)s)",
    )
    g.add_argument(
        "--max-model-len", type=int, help="cap the context length (default: the model's)"
    )
    g.add_argument("--seed", type=int, default=e.seed, help="sampling seed of requests without one")
    g.add_argument(
        "--threads",
        type=int,
        help="torch threads of the engine process (default: the cores it may use, minus one)",
    )


def _add_cache(p: argparse.ArgumentParser) -> None:
    c = CacheConfig(disk_cache_dir=None)
    g = p.add_argument_group("cache")
    g.add_argument(
        "--page-size",
        type=int,
        default=c.page_size,
        help="tokens per KV page (default %(default)s)",
    )
    g.add_argument(
        "--device-cache-tokens",
        type=int,
        default=c.device_cache_tokens,
        help="L1 capacity in tokens, on the engine device (default %(default)s)",
    )
    g.add_argument(
        "--host-cache-gb",
        type=float,
        default=c.host_cache_gb,
        help="L2 shared-memory pool size in GB; 0 disables it (default %(default)s)",
    )
    g.add_argument("--no-host-cache", action="store_true", help="disable the L2 host tier")
    g.add_argument(
        "--disk-cache-dir",
        type=Path,
        default=default_disk_cache_dir(),
        help="L3 folder, kept across restarts (default %(default)s)",
    )
    g.add_argument(
        "--disk-cache-gb",
        type=float,
        default=c.disk_cache_gb,
        help="L3 capacity in GB, files already there included (default %(default)s)",
    )
    g.add_argument("--no-disk-cache", action="store_true", help="disable the L3 disk tier")
    g.add_argument(
        "--remote-url", help="L4 Redis/Valkey URL, e.g. redis://127.0.0.1:6379/0 (default: off)"
    )
    g.add_argument(
        "--remote-ttl", type=int, help="L4 value expiry in seconds (default: the server evicts)"
    )
    g.add_argument(
        "--write-policy",
        default=c.write_policy.value,
        choices=[w.value for w in WritePolicy],
        help="when L1 pages are copied to L2 (default %(default)s)",
    )
    g.add_argument(
        "--write-through-threshold",
        type=int,
        default=c.write_through_threshold,
        help="hits before write_through_selective copies a page (default %(default)s)",
    )
    g.add_argument(
        "--prefetch-policy",
        default=c.prefetch_policy.value,
        choices=[x.value for x in PrefetchPolicy],
        help="how long a request waits for its L3/L4 prefix (default %(default)s)",
    )
    g.add_argument(
        "--prefetch-timeout",
        type=float,
        default=c.prefetch_timeout_s,
        help="seconds the 'timeout' prefetch policy waits (default %(default)s)",
    )
    g.add_argument(
        "--disk-admit-hits",
        type=int,
        default=c.disk_admit_hits,
        help="write a page to L3 only after this many hits (default %(default)s)",
    )
    g.add_argument(
        "--disk-admit-tokens",
        type=int,
        default=c.disk_admit_tokens,
        help="...or when its prompt has at least this many tokens (default %(default)s)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching entirely")


def _add_seed_aliases(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("aliases of the seed's flags")
    g.add_argument(
        "--use_hiradix_cache",
        action="store_true",
        help="enable the host tier (L2): undoes --no-host-cache",
    )
    g.add_argument(
        "--hiradix_cache_gpu",
        action="store_true",
        help="keep the first cache level (L1) on the GPU: same as --device cuda",
    )
    g.add_argument(
        "--hiradix_cache_token_num",
        type=int,
        help="host tier (L2) capacity in tokens instead of --host-cache-gb",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynchicache serve",
        description="Run the OpenAI-compatible server with the hierarchical KV cache.",
    )
    _add_server(p)
    _add_engine(p)
    _add_cache(p)
    _add_seed_aliases(p)
    return p


def _device(args: argparse.Namespace) -> str:
    if args.hiradix_cache_gpu:
        if args.device not in ("auto",) and not args.device.startswith("cuda"):
            raise ValueError(
                f"--hiradix_cache_gpu puts L1 on the GPU; it contradicts --device {args.device}"
            )
        return "cuda" if args.device == "auto" else args.device
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_remote_url(url: str | None) -> None:
    """A malformed --remote-url fails now, not in the cache service after the model loaded."""
    if url is not None:
        from asynchicache.storage.redis_topology import parse_remote_url  # pulls in redis-py

        parse_remote_url(url)


def _cache(args: argparse.Namespace) -> CacheConfig:
    _check_remote_url(args.remote_url)
    return CacheConfig(
        page_size=args.page_size,
        device_cache_tokens=args.device_cache_tokens,
        host_cache_gb=args.host_cache_gb,
        enable_host_cache=args.use_hiradix_cache or not args.no_host_cache,
        write_policy=WritePolicy(args.write_policy),
        write_through_threshold=args.write_through_threshold,
        prefetch_policy=PrefetchPolicy(args.prefetch_policy),
        prefetch_timeout_s=args.prefetch_timeout,
        enable_prefix_cache=not args.no_prefix_cache,
        disk_cache_dir=None if args.no_disk_cache else args.disk_cache_dir.expanduser(),
        disk_cache_gb=args.disk_cache_gb,
        disk_admit_hits=args.disk_admit_hits,
        disk_admit_tokens=args.disk_admit_tokens,
        remote_url=args.remote_url,
        remote_ttl_s=args.remote_ttl,
    )


def to_config(args: argparse.Namespace) -> LaunchConfig:
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=args.log_level,
        served_model_name=args.served_model_name,
        startup_timeout_s=args.startup_timeout,
    )
    engine = EngineConfig(
        model=args.model,
        device=_device(args),
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        threads=args.threads,
    )
    return LaunchConfig(
        server, engine, _cache(args), host_cache_tokens=args.hiradix_cache_token_num
    )


def main(argv: list[str]) -> int:
    """`asynchicache serve ...`: parse, validate, run until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = to_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    import logging

    from asynchicache.server.launch import launch

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return launch(config)
