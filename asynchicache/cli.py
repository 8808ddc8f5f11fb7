"""Command line: `asynchicache serve | bench ... | cache ...`.

Sub-commands import their layer lazily so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from asynchicache.server.options import main as serve_main

    return serve_main(rest)


# bench sub-command -> module whose `main(argv) -> int` runs it
BENCHMARKS = {
    "micro": "asynchicache.bench.micro",
    "engine": "asynchicache.bench.engine",
    "serve": "asynchicache.bench.client",
    "sweep": "asynchicache.bench.sweep",
    "soak": "asynchicache.bench.soak",
    "compare": "asynchicache.bench.compare",
}


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(BENCHMARKS[args.bench_cmd])
    return int(module.main(rest) or 0)


def _cmd_cache(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise SystemExit(f"asynchicache cache: unknown arguments {rest}")
    deep_only = {"--model": args.model, "--sample": args.sample, "--tolerance": args.tolerance,
                 "--keep": args.keep or None, "--audit-device": args.audit_device}  # fmt: skip
    given = [flag for flag, value in deep_only.items() if value is not None]
    if given and not args.deep:
        raise SystemExit(f"asynchicache cache: {', '.join(given)} only go with verify --deep")
    if args.deep:
        return _deep_verify(args)
    from asynchicache.storage.disk_admin import cache_command

    return cache_command(args.cache_cmd, args.disk_cache_dir, as_json=args.json)


def _deep_verify(args: argparse.Namespace) -> int:
    if args.cache_cmd != "verify":
        raise SystemExit("asynchicache cache: --deep goes with verify")
    from asynchicache.config import default_disk_cache_dir
    from asynchicache.engine.audit import DEFAULT_TOLERANCE, AuditConfig, audit_command

    try:
        config = AuditConfig(
            args.disk_cache_dir or default_disk_cache_dir(),
            model=args.model,
            sample=args.sample,
            tolerance=DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance,
            keep=args.keep,
            device=args.audit_device or "cpu",
        )
    except ValueError as exc:
        raise SystemExit(f"asynchicache cache verify --deep: {exc}") from None
    return audit_command(config, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynchicache", description="Hierarchical asynchronous prompt KV cache and server."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server", add_help=False)
    serve.set_defaults(func=_cmd_serve)
    # No -h of its own: `bench serve --help` reaches the sub-command's parser.
    bench = sub.add_parser("bench", help="benchmarks", add_help=False)
    bench.add_argument(
        "bench_cmd", choices=sorted(BENCHMARKS), help="which benchmark"
    )
    bench.set_defaults(func=_cmd_bench)
    cache = sub.add_parser("cache", help="inspect, verify or clear the disk cache (no service)")
    cache.add_argument("cache_cmd", choices=["stats", "verify", "clear"], help="what to do")
    cache.add_argument("--disk-cache-dir", type=Path, default=None, help="default: ~/.cache/...")
    cache.add_argument("--json", action="store_true", help="machine-readable output")
    cache.add_argument(
        "--deep",
        action="store_true",
        help="verify: also recompute every page whose chain is in the folder with the model "
        "(no cache) and compare its K/V (exit 1 on a mismatch)",
    )
    cache.add_argument("--model", default=None, help="--deep: the model (default: the embedded)")
    cache.add_argument("--sample", type=int, default=None, help="--deep: check N random pages")
    cache.add_argument(
        "--tolerance", type=float, default=None, help="--deep: max abs difference (1e-3)"
    )
    cache.add_argument(
        "--keep", action="store_true", help="--deep: report only, remove no file"
    )
    cache.add_argument("--audit-device", default=None, help="--deep: torch device (cpu)")
    cache.set_defaults(func=_cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    return int(args.func(args, rest) or 0)
