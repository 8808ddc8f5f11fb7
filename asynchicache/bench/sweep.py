"""`asynchicache bench sweep`: one workload against the server in every tier configuration.

    asynchicache bench sweep --workload multiturn --out DIR [--scale X] [--remote-url URL]

For each setup (no prefix cache; L1; L1+L2; L1+L2+L3; L1+L2+L3+L4 with a
Redis URL) it starts `python -m asynchicache serve` on a free port with a
fresh disk folder and tiers sized from the workload's working set
(`setups.size_tiers`), sends one warm-up request, plays the workload, reads
`/cache/stats`, and stops the server. `--workload restart` plays a base
workload (`--restart-of`, default longdoc), restarts the server on the same
disk folder and plays it again: the second run is the one measured (the L4
setup restarts on an empty disk folder, as a second instance sharing Redis).

Under --out: `summary.json`, `table.md`, PNG plots, and per setup the request
results, the engine's cache stats and the server log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from asynchicache.bench.clients.client import (
    ClientConfig,
    Run,
    add_workload_arguments,
    run_workload,
)
from asynchicache.bench.processes.server_log import read_load_events
from asynchicache.bench.processes.server_process import BenchServer, ServerError, start_server_bench
from asynchicache.bench.reports.output import add_output_arguments, print_report
from asynchicache.bench.reports.run_results import RequestResult, write_results
from asynchicache.bench.reports.summary import summarize
from asynchicache.bench.workloads import text
from asynchicache.bench.workloads.prompts import chat_ids, ideal_of_run, planned_messages
from asynchicache.bench.workloads.setups import (
    ServerPlan,
    Setup,
    Sizing,
    pick_setups,
    server_flags,
    size_tiers,
)
from asynchicache.bench.workloads.workloads import WORKLOADS, Workload, make_workload
from asynchicache.model.tokenizer import Tokenizer
from asynchicache.settings.config_flags import add_config_flags, config_kwargs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepOptions:
    workload: str  # a workload name, or "restart"
    out: Path
    restart_of: str = "longdoc"
    seed: int = 0
    scale: float = 1.0
    assignments: tuple[str, ...] = ()
    setups: tuple[str, ...] = ()  # slugs; empty = all that apply
    remote_url: str | None = None
    model: str | None = None
    page_size: int = 16
    l1_ratio: float = 4.0
    l2_ratio: float = 2.0
    max_running_requests: int | None = None  # None: the server's (admission by memory)
    max_concurrency: int | None = None
    threads: int | None = None  # the servers' --threads; None: their default
    server_args: tuple[str, ...] = ()
    work_dir: Path | None = None  # where disk folders go (default: the temp dir)
    keep_disk: bool = False
    progress: bool = True
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.workload != "restart" and self.workload not in WORKLOADS:
            raise ValueError(
                f"unknown workload {self.workload!r}; known: {', '.join([*WORKLOADS, 'restart'])}"
            )
        if self.restart_of not in WORKLOADS:
            raise ValueError(f"--restart-of must be one of {', '.join(WORKLOADS)}")

    @property
    def restart(self) -> bool:
        return self.workload == "restart"

    @property
    def base_workload(self) -> str:
        return self.restart_of if self.restart else self.workload


@dataclass
class _Context:
    """What every setup of one sweep shares."""

    opts: SweepOptions
    workload: Workload
    tokenizer: Tokenizer
    kv_bytes_per_token: int
    sizing: Sizing
    salt: str
    temp_dirs: list[Path] = field(default_factory=list)

    def disk_dir(self) -> Path:
        base = self.opts.work_dir
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix="asynchicache-sweep-", dir=base))
        self.temp_dirs.append(d)
        return d


@dataclass(frozen=True)
class Phase:
    """One run of the workload against one server."""

    run: Run
    cache_stats: dict[str, Any]
    flags: tuple[str, ...]
    startup_s: float  # from spawning the server to its first /health answer
    load_events: dict[str, Any]  # late / short loads and failed stores, from the server log


# ------------------------------------------------------------------- planning
def plan_sizing(workload: Workload, tokenizer: Tokenizer, opts: SweepOptions) -> Sizing:
    """Tier sizes from the prompts the workload will send (answers: max_tokens of filler)."""
    from asynchicache.bench.workloads.ideal import replay

    filler = text.paragraph(random.Random(opts.seed), workload.max_tokens)
    ids = [chat_ids(tokenizer, m) for m in planned_messages(workload, filler)]
    rep = replay(ids, opts.page_size)
    largest = max(len(t) for t in ids) + workload.max_tokens
    sizing = size_tiers(
        rep.working_set_tokens, largest, opts.page_size, opts.l1_ratio, opts.l2_ratio
    )
    if opts.max_running_requests is not None:
        sizing = replace(sizing, max_running_requests=opts.max_running_requests)
    return sizing


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------- running
def thread_flags(threads: int | None) -> list[str]:
    """`--threads` for every server of the sweep; none: the server's own default
    (`engine.threads.ThreadGovernor`: the cores other processes leave free), the same as
    a plain `serve`."""
    return [] if threads is None else ["--threads", str(threads)]


def _warm_up(url: str) -> None:
    """One short request in its own namespace: the first forward pass is slow everywhere."""
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": "bench-warmup",
    }
    httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()


def _run_phase(ctx: _Context, setup: Setup, disk_dir: Path, out_dir: Path) -> Phase:
    plan = ServerPlan(
        ctx.sizing,
        ctx.kv_bytes_per_token,
        disk_dir,
        ctx.opts.remote_url,
        extra=ctx.opts.server_args,
    )
    flags = [*server_flags(setup, plan), *thread_flags(ctx.opts.threads)]
    (out_dir / "server.log").unlink(missing_ok=True)
    server = BenchServer(flags, out_dir / "server.log", ctx.opts.startup_timeout_s)
    started = time.perf_counter()
    with server:
        startup_s = time.perf_counter() - started
        _warm_up(server.url)
        cfg = ClientConfig(
            server.url,
            cache_salt=ctx.salt,
            max_concurrency=ctx.opts.max_concurrency,
            progress=ctx.opts.progress,
            label=setup.name,
        )
        run = run_workload(ctx.workload, cfg)
        stats = server.get_json("/cache/stats")
    write_results(out_dir / "results.jsonl", run.results)
    (out_dir / "cache_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    events = read_load_events(out_dir / "server.log")
    return Phase(run, stats, tuple(flags), startup_s, events)


def _describe(
    ctx: _Context, setup: Setup, phase: Phase, warm: Sequence[RequestResult] = ()
) -> dict[str, Any]:
    s = summarize(phase.run.results, phase.run.duration_s)
    ideal = ideal_of_run(
        ctx.workload,
        phase.run.results,
        ctx.opts.model,
        ctx.opts.page_size,
        ctx.tokenizer,
        warm=warm,
    )
    return {
        "setup": setup.slug,
        "mean_ttft_s": s.ttft.mean,
        "p50_ttft_s": s.ttft.p50,
        "p90_ttft_s": s.ttft.p90,
        "p99_ttft_s": s.ttft.p99,
        "hit_rate": s.hit_rate,
        "ideal_hit_rate": ideal["hit_rate"],
        "hit_rate_by_tier": s.hit_rate_by_tier,
        "requests_per_s": s.requests_per_s,
        "output_tokens_per_s": s.output_tokens_per_s,
        "total_tokens_per_s": s.total_tokens_per_s,
        "mean_itl_s": s.itl.mean,
        "mean_e2e_s": s.e2e.mean,
        "requests": s.requests,
        "errors": s.errors,
        "duration_s": s.duration_s,
        **preemption_rate(phase.cache_stats.get("preemptions"), s.requests),
        "startup_s": phase.startup_s,
        # The engine's own running estimate: how fast this machine was during the run.
        "engine_prefill_tok_s": phase.cache_stats.get("prefill_tok_s_estimate"),
        "torch_threads_at_end": phase.cache_stats.get("torch_threads"),
        "load_events": phase.load_events,
        "flags": list(phase.flags),
        "run": s.to_dict(),
        "ideal": ideal,
        "cache_stats": phase.cache_stats,
    }


# More preemptions per request than this is a storm: requests preempting each other
# over and over, their prefill thrown away each time.
STORM_PREEMPTIONS_PER_REQUEST = 0.05


def preemption_rate(preemptions: int | None, requests: int) -> dict[str, Any]:
    """The engine's preemptions, per request of the run, and whether that is a storm."""
    if preemptions is None or requests <= 0:
        return {
            "preemptions": preemptions,
            "preemptions_per_request": None,
            "preemption_storm": None,
        }
    rate = preemptions / requests
    return {
        "preemptions": preemptions,
        "preemptions_per_request": rate,
        "preemption_storm": rate > STORM_PREEMPTIONS_PER_REQUEST,
    }


def _run_setup(ctx: _Context, setup: Setup) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the measured run, the first run of a restart or None)."""
    out = ctx.opts.out / setup.slug
    disk = ctx.disk_dir()
    if not (ctx.opts.restart and setup.persistent):
        phase = _run_phase(ctx, setup, disk, out)
        # After a restart the ideal is an unbounded cache that kept the first run's
        # pages; a setup that keeps nothing across restarts runs once, and the same
        # prompts stand in for that first run, so every row has the same ideal.
        warm = phase.run.results if ctx.opts.restart else ()
        return _describe(ctx, setup, phase, warm), None
    first = _run_phase(ctx, setup, disk, out / "before-restart")
    # A second instance sharing Redis has its own, empty disk.
    disk_after = ctx.disk_dir() if setup.remote else disk
    second = _run_phase(ctx, setup, disk_after, out)
    warm = first.run.results
    return _describe(ctx, setup, second, warm), _describe(ctx, setup, first)


def _context(opts: SweepOptions) -> _Context:
    from asynchicache.launch.frontend import load_frontend

    workload = make_workload(opts.base_workload, opts.seed, opts.scale, opts.assignments)
    frontend = load_frontend(opts.model)
    dtype = _server_dtype(opts.server_args)
    sizing = plan_sizing(workload, frontend.tokenizer, opts)
    return _Context(
        opts,
        workload,
        frontend.tokenizer,
        frontend.kv_bytes_per_token(dtype),
        sizing,
        salt=f"sweep-{secrets.token_hex(4)}",
    )


def _server_dtype(server_args: Sequence[str]) -> str:
    args = list(server_args)
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--dtype="):
            return a.split("=", 1)[1]
    return "float32"


def sweep(opts: SweepOptions) -> dict[str, Any]:
    """Run every setup; write summary.json, table.md and the plots under `opts.out`."""
    from asynchicache.bench.reports.report import write_report

    setups = pick_setups(opts.setups, opts.remote_url)
    opts.out.mkdir(parents=True, exist_ok=True)
    ctx = _context(opts)
    log.info(
        "working set %d tokens; L1 %d tokens, L2 %d tokens",
        ctx.sizing.working_set_tokens,
        ctx.sizing.device_cache_tokens,
        ctx.sizing.host_cache_tokens,
    )
    summary: dict[str, Any] = {
        "workload": opts.workload,
        "base_workload": ctx.workload.name,
        "params": dict(ctx.workload.params),
        "seed": opts.seed,
        "scale": opts.scale,
        "requests": len(ctx.workload.requests),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "threads": opts.threads if opts.threads is not None else "auto",
        "sizing": {**asdict(ctx.sizing), "working_set_over_l1": ctx.sizing.working_set_over_l1},
        "configs": {},
        "failed": {},
    }
    if opts.restart:
        summary["before_restart"] = {}
    try:
        for setup in setups:
            try:
                measured, first = _run_setup(ctx, setup)
            except (ServerError, httpx.HTTPError) as exc:
                log.error("setup %s failed: %s", setup.name, exc)
                summary["failed"][setup.name] = str(exc)[-2000:]
                continue
            summary["configs"][setup.name] = measured
            if first is not None:
                summary["before_restart"][setup.name] = first
            log.info(
                "%s: mean TTFT %.3fs, hit rate %.3f (ideal %.3f)",
                setup.name,
                measured["mean_ttft_s"],
                measured["hit_rate"],
                measured["ideal_hit_rate"],
            )
    finally:
        if not opts.keep_disk:
            for d in ctx.temp_dirs:
                shutil.rmtree(d, ignore_errors=True)
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(opts.out, summary)
    return summary


# ------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynchicache bench sweep",
        description="Start the server in each tier configuration and play one workload.",
    )
    add_output_arguments(p, "summary.json (table.md, plots and logs beside it)", out_required=True)
    add_config_flags(p, SweepOptions, {
        "--restart-of": "the workload that --workload restart plays twice",
        "--l1-ratio": "working set / L1 size",
        "--l2-ratio": "L2 size / L1 size",
        "--startup-timeout": "seconds to wait for each server",
    })  # fmt: skip
    p.add_argument("--remote-url", help="Redis URL: adds the L1+L2+L3+L4 setup")
    p.add_argument("--setups", help="comma-separated subset, e.g. l1,l1-l2-l3 (default: all)")
    p.add_argument(
        "--max-running-requests",
        type=int,
        help="the engine's cap on running requests (default: the server's; it admits by L1 memory)",
    )
    p.add_argument(
        "--threads",
        "--torch-threads",
        dest="threads",
        type=int,
        help="the servers' --threads (default: theirs, what other processes leave)",
    )
    p.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to every `asynchicache serve` (repeatable; "
        "use --server-arg=--flag for flags)",
    )
    p.add_argument("--work-dir", type=Path, help="where the disk tier folders go (default: tmp)")
    p.add_argument("--keep-disk", action="store_true", help="keep the disk tier folders")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the workload's size and the tier sizes, start nothing",
    )
    add_workload_arguments(p)
    return p


def options_from_args(args: argparse.Namespace) -> SweepOptions:
    setups = tuple(s.strip() for s in args.setups.split(",") if s.strip()) if args.setups else ()
    server_args = tuple(args.server_args)
    if args.model is not None:  # the server loads the same model the prompts are tokenized for
        server_args = (*server_args, "--model", args.model)
    return SweepOptions(
        **config_kwargs(
            SweepOptions,
            args,
            assignments=tuple(args.assignments),
            setups=setups,
            server_args=server_args,
            progress=not args.no_progress,
        )
    )


def plan(opts: SweepOptions) -> dict[str, Any]:
    """What a sweep would run: the workload's size and the tiers' sizes."""
    ctx = _context(opts)
    filler = text.paragraph(random.Random(opts.seed), ctx.workload.max_tokens)
    convs = planned_messages(ctx.workload, filler)
    return {
        "workload": ctx.workload.name,
        "params": dict(ctx.workload.params),
        "requests": len(ctx.workload.requests),
        "planned_prompt_tokens": sum(len(chat_ids(ctx.tokenizer, m)) for m in convs),
        "sizing": {**asdict(ctx.sizing), "working_set_over_l1": ctx.sizing.working_set_over_l1},
    }


def main(argv: Sequence[str]) -> int:
    args, opts = start_server_bench("sweep", _parser(), argv, options_from_args)
    if args.dry_run:
        print(json.dumps(plan(opts), indent=2))
        return 0
    summary = sweep(opts)
    print_report(args, summary, (opts.out / "table.md").read_text())
    bad = summary["failed"] or any(c["errors"] for c in summary["configs"].values())
    return 1 if bad else 0
