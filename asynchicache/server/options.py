"""`asynchicache serve` flags (and an optional YAML config file) -> `LaunchConfig`.

This module only turns argv into configuration; the configs themselves, their
defaults and their validation live in `asynchicache.config`. Every size flag
counts GiB (2**30 bytes).

LightLLM's flag names are accepted, each mapped to exactly one of ours:

    --use_hiradix_cache           the host tier (L2) on; it is on by default, so
                                  this only overrides --no-host-cache
    --hiradix_cache_gpu           L1 on the GPU: --device cuda (an error with --device cpu)
    --hiradix_cache_token_num N   L2 capacity of N tokens, rounded up to whole
                                  pages, instead of --host-cache-gb
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from asynchicache.config import (
    CacheConfig,
    EngineConfig,
    LaunchConfig,
    PrefetchPolicy,
    ServerConfig,
    ServiceTuning,
    WritePolicy,
    default_disk_cache_dir,
)

API_KEY_ENV = "ASYNCHICACHE_API_KEY"
ADMIN_API_KEY_ENV = "ASYNCHICACHE_ADMIN_API_KEY"
DEFAULT_STORAGE_TIMEOUT_S = LaunchConfig.storage_timeout_s


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
        help=f"require 'Authorization: Bearer KEY' on all but /health and /ready "
        f"(or ${API_KEY_ENV})",
    )
    g.add_argument(
        "--admin-api-key",
        default=os.environ.get(ADMIN_API_KEY_ENV),
        help="require this key (instead of --api-key) on /cache/clear, /cache/pin and "
        f"/cache/unpin (or ${ADMIN_API_KEY_ENV})",
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
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=s.shutdown_timeout_s,
        help="seconds each child gets to stop before SIGKILL (default %(default)s)",
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
        help="at most this many requests run at once; below it, a request is admitted "
        "when L1 can hold it (default %(default)s)",
    )
    g.add_argument(
        "--decode-reserve-tokens",
        type=int,
        default=e.decode_reserve_tokens,
        help="L1 room admission keeps per request for its answer, in tokens (at most its "
        "max_tokens; default %(default)s)",
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
        "--min-load-tokens",
        type=int,
        default=e.min_load_tokens,
        help="load a prefix from L2/L3/L4 only when it has at least this many tokens "
        "(default %(default)s)",
    )
    g.add_argument(
        "--threads",
        type=int,
        help="torch threads of the engine process (default: every core the other processes "
        "leave free, measured as it runs; it starts at cores - 1)",
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
        help="L2 shared-memory pool size in GiB (2**30 bytes); 0 disables it "
        "(default %(default)s)",
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
        help="L3 capacity in GiB (2**30 bytes), files already there included "
        "(default %(default)s)",
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
        "--max-quarantine-fraction",
        type=float,
        default=c.max_quarantine_fraction,
        help="share of L2 slots that timed-out storage work may hold before new storage "
        "loads and stores pause (default %(default)s)",
    )
    g.add_argument(
        "--max-pinned-fraction",
        type=float,
        default=c.max_pinned_fraction,
        help="share of the host tier (L2) and of the disk tier (L3, the whole folder) that "
        "pinned pages may take; a pin past it is refused with 409 (default %(default)s)",
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
    g.add_argument(
        "--storage-timeout",
        type=float,
        default=DEFAULT_STORAGE_TIMEOUT_S,
        metavar="SECONDS",
        help="how long the engine waits for one L3/L4 load or store of the cache service "
        "before it recomputes instead; a service silent for 3x this long is restarted "
        "(default %(default)s)",
    )


def _add_service(p: argparse.ArgumentParser) -> None:
    t = ServiceTuning()
    g = p.add_argument_group("cache service (the L3/L4 process)")
    g.add_argument(
        "--disk-sync",
        default=t.disk_sync,
        choices=["batch", "file", "none"],
        help="durability of stored pages: one syncfs per store, fdatasync per file, or none "
        "(default %(default)s)",
    )
    g.add_argument(
        "--io-threads",
        type=int,
        default=t.io_threads,
        help="parallel file reads and writes per namespace (default %(default)s)",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=t.workers,
        help="cache-service requests (loads, stores) served at once (default %(default)s)",
    )
    g.add_argument(
        "--client-ttl",
        type=float,
        default=t.client_ttl_s,
        help="seconds after which the service forgets a silent engine (default %(default)s)",
    )


def _add_kv_events(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV events (for KV-cache-aware routers)")
    g.add_argument(
        "--kv-events-endpoint",
        metavar="ADDR",
        help="publish every tier's page stores and removals on this ZeroMQ PUB address, "
        "e.g. tcp://127.0.0.1:5557 (msgpack batches, vLLM's event shapes; default: off)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ADDR",
        help="answer requests for the current contents of every tier on this ZeroMQ ROUTER "
        "address, e.g. tcp://127.0.0.1:5558 (a late or lagging subscriber catches up)",
    )


def _add_lightllm_aliases(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LightLLM-compatible flags")
    g.add_argument(
        "--use_hiradix_cache",
        action="store_true",
        help="turn the host tier (L2) on; it is on by default, so this only overrides "
        "--no-host-cache",
    )
    g.add_argument(
        "--hiradix_cache_gpu",
        action="store_true",
        help="L1 on the GPU: the same as --device cuda (an error with --device cpu)",
    )
    g.add_argument(
        "--hiradix_cache_token_num",
        type=int,
        help="L2 capacity in tokens (rounded up to whole pages), instead of --host-cache-gb",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynchicache serve",
        description="Run the OpenAI-compatible server with the hierarchical KV cache.",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE.yaml",
        help="read flags from a YAML mapping (keys: flag names, e.g. disk-cache-gb: 50); "
        "flags given on the command line win",
    )
    _add_server(p)
    _add_engine(p)
    _add_cache(p)
    _add_service(p)
    _add_kv_events(p)
    _add_lightllm_aliases(p)
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
        max_quarantine_fraction=args.max_quarantine_fraction,
        max_pinned_fraction=args.max_pinned_fraction,
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
        admin_api_key=args.admin_api_key,
        log_level=args.log_level,
        served_model_name=args.served_model_name,
        startup_timeout_s=args.startup_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    engine = EngineConfig(
        model=args.model,
        device=_device(args),
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        decode_reserve_tokens=args.decode_reserve_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_model_len=args.max_model_len,
        min_load_tokens=args.min_load_tokens,
        seed=args.seed,
        threads=args.threads,
    )
    if args.kv_events_endpoint is not None:  # a malformed address fails now
        from asynchicache.engine.kv_events import KvEventsConfig

        KvEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint)
    service = ServiceTuning(
        disk_sync=args.disk_sync,
        io_threads=args.io_threads,
        workers=args.workers,
        client_ttl_s=args.client_ttl,
    )
    return LaunchConfig(
        server,
        engine,
        _cache(args),
        service,
        host_cache_tokens=args.hiradix_cache_token_num,
        storage_timeout_s=args.storage_timeout,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
    )


def _file_value(action: argparse.Action, key: str, value: Any, path: Path) -> Any:
    """A config-file value as the flag would have parsed it (same types and choices)."""
    where = f"--config {path}: {key}"
    if action.nargs == 0:  # a switch such as --no-disk-cache
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: use true or false, got {value!r}")
        return value
    if value is None:
        return None
    if isinstance(value, dict | list | bool):
        raise ValueError(f"{where} must be a single value, got {value!r}")
    try:
        parsed = action.type(value) if callable(action.type) else value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(f"{where} must be one of {list(action.choices)}, got {value!r}")
    return parsed


def config_file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Flag defaults from a YAML file: `{dest: value}`; unknown keys are an error."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            known = ", ".join(sorted(d.replace("_", "-") for d in actions))
            raise ValueError(f"--config {path}: unknown flag {key!r}; known: {known}")
        out[dest] = _file_value(action, str(key), value, path)
    return out


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
    try:
        config = to_config(args)
    except ValueError as exc:
        build_parser().error(str(exc))
    import logging

    from asynchicache.server.launch import launch

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return launch(config)
