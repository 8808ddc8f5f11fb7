"""Command line: `asynchicache serve | bench ... | cache ... | model ...`.

Sub-commands import their layer lazily so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from asynchicache.settings.config_flags import finite_float


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from asynchicache.launch.options import main as serve_main

    return serve_main(rest)


def _cmd_service(args: argparse.Namespace, rest: list[str]) -> int:
    from asynchicache.storage.service.service_cli import main as service_main

    return service_main(rest)


# bench sub-command -> module whose `main(argv) -> int` runs it
BENCHMARKS = {
    "micro": "asynchicache.bench.micro.micro",
    "engine": "asynchicache.bench.engine_speed",
    "kernels": "asynchicache.bench.micro.kernels",
    "serve": "asynchicache.bench.clients.client",
    "sweep": "asynchicache.bench.sweep",
    "soak": "asynchicache.bench.soak",
    "compare": "asynchicache.bench.compare",
    "vllm": "asynchicache.bench.vllm",
    "prefetch": "asynchicache.bench.prefetch_at_arrival",
    "pressure": "asynchicache.bench.pressure",
    "fleet": "asynchicache.bench.fleet.fleet",
}

# model sub-command -> module whose `main(argv) -> int` runs it
MODEL_COMMANDS = {
    "export-hf": "asynchicache.tools.export_hf",
}
FLEET_COMMANDS = {
    "credits": "asynchicache.fleet.credits",
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
    clear_only = {"--remote-url": args.remote_url, "--namespace": args.namespace or None,
                  "--cache-salt": args.cache_salt, "--include-pinned": args.include_pinned or None,
                  "--all-remote-namespaces": args.all_remote_namespaces or None,
                  "--force": args.force or None}  # fmt: skip
    given = [flag for flag, value in clear_only.items() if value is not None]
    if given and args.cache_cmd != "clear":
        raise SystemExit(f"asynchicache cache: {', '.join(given)} only go with clear")
    from asynchicache.settings.config import default_disk_cache_dir

    root = args.disk_cache_dir or default_disk_cache_dir()
    if args.cache_cmd == "clear":
        return _clear(args, root)
    from asynchicache.storage.disk.disk_admin import cache_command

    return cache_command(args.cache_cmd, root, as_json=args.json)


def _clear(args: argparse.Namespace, root: Path) -> int:
    """`cache clear`: the folder's namespaces and, with --remote-url, their Redis keys."""
    import json

    from asynchicache.storage.service.offline_clear import ClearRequest, clear_offline

    root_of = None
    if args.cache_salt is not None:
        from asynchicache.common.keys import Namespace

        salt = args.cache_salt
        root_of = lambda ns: Namespace.decode(ns).with_salt(salt).digest()  # noqa: E731
    if args.all_remote_namespaces and (args.remote_url is None or root_of is not None):
        raise SystemExit("asynchicache cache clear: --all-remote-namespaces needs --remote-url "
                         "and no --cache-salt")  # fmt: skip
    try:
        request = ClearRequest(root, args.remote_url, tuple(args.namespace), args.include_pinned,
                               args.all_remote_namespaces, root_of, args.force)  # fmt: skip
        report = clear_offline(request).as_dict()
    except ValueError as exc:
        raise SystemExit(f"asynchicache cache clear: {exc}") from None
    if args.json:
        print(json.dumps(report))
    else:
        for tier in ("disk", "remote"):
            part = report[tier]
            print(f"{tier}: removed {part['removed']} pages, kept {part['pinned_kept']} pinned")
            for error in part["errors"]:
                print(f"  {error}")
    failed = report["disk"]["errors"] or report["remote"]["errors"]
    return 1 if failed else 0


def _cmd_model(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(MODEL_COMMANDS[args.model_cmd])
    return int(module.main(rest) or 0)


def _cmd_fleet(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(FLEET_COMMANDS[args.fleet_cmd])
    return int(module.main(rest) or 0)


def _deep_verify(args: argparse.Namespace) -> int:
    if args.cache_cmd != "verify":
        raise SystemExit("asynchicache cache: --deep goes with verify")
    from asynchicache.settings.config import default_disk_cache_dir
    from asynchicache.tools.audit import DEFAULT_TOLERANCE, AuditConfig, audit_command

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
    service = sub.add_parser("service", help="run the cache service alone", add_help=False)
    service.set_defaults(func=_cmd_service)
    # No -h of its own: `bench serve --help` reaches the sub-command's parser.
    bench = sub.add_parser("bench", help="benchmarks", add_help=False)
    bench.add_argument("bench_cmd", choices=sorted(BENCHMARKS), help="which benchmark")
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
        "--tolerance",
        type=finite_float,
        default=None,
        help="--deep: max abs difference (1e-3)",
    )
    cache.add_argument("--keep", action="store_true", help="--deep: report only, remove no file")
    cache.add_argument("--audit-device", default=None, help="--deep: torch device (cpu)")
    cache.add_argument(
        "--remote-url", default=None, help="clear: also the remote tier (Redis/Valkey) keys"
    )
    cache.add_argument(
        "--namespace", action="append", default=[],
        help="clear: only this namespace folder (ns-..., as `cache stats` lists); repeatable",
    )  # fmt: skip
    cache.add_argument(
        "--cache-salt", default=None, help="clear: only the pages of this cache_salt's chains"
    )
    cache.add_argument(
        "--include-pinned", action="store_true", help="clear: pinned pages (and pins) too"
    )
    cache.add_argument(
        "--all-remote-namespaces", action="store_true",
        help="clear: every asynchicache key (ackv:*) in the remote tier, known to the folder "
        "or not",
    )  # fmt: skip
    cache.add_argument(
        "--force", action="store_true",
        help="clear: also namespaces a running server uses (refused without it)",
    )  # fmt: skip
    cache.set_defaults(func=_cmd_cache)
    # No -h of its own either: `model export-hf --help` reaches the sub-command's parser.
    model = sub.add_parser("model", help="model tools (export-hf)", add_help=False)
    model.add_argument("model_cmd", choices=sorted(MODEL_COMMANDS), help="what to do")
    model.set_defaults(func=_cmd_model)
    fleet = sub.add_parser("fleet", help="fleet tools (credits)", add_help=False)
    fleet.add_argument("fleet_cmd", choices=sorted(FLEET_COMMANDS), help="what to do")
    fleet.set_defaults(func=_cmd_fleet)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    return int(args.func(args, rest) or 0)
