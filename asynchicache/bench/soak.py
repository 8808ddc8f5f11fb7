"""`asynchicache bench soak`: a long run of many streaming clients against a live server.

    asynchicache bench soak --url http://127.0.0.1:8000 --clients 16 --duration 600

Each client loops over greedy chat and completion requests whose prompts share
a few long system prefixes (so every cache tier works), streams the answer,
and on purpose abandons a share of them mid-stream (`--disconnect-rate`). The
run reports:

* errors (anything but a complete stream, the deliberate disconnects aside) and
  answers that differ from an earlier greedy answer to the same prompt;
* time to first token and end-to-end latency percentiles;
* every `--sample-interval` seconds, for each server process (found from the
  port: `asynchicache: http|engine|cache-service`): resident memory split into
  private and shared pages, open files and threads; and the `/dev/shm`
  segments they own;
* at the end, once idle: no page still in use, and the engine's
  `check_integrity()` (`/cache/stats?integrity=true`).

It passes (exit 0) when there were no errors and no differing answers, the
integrity check held, private memory and open files stayed flat after the
warm-up and shared memory stayed within the configured L2 pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

from asynchicache.bench.clients.soak_clients import Tally, client_loop, make_prompts
from asynchicache.bench.processes.procwatch import ServerSample, ServerWatch
from asynchicache.bench.reports.output import add_output_arguments, print_report, write_report
from asynchicache.bench.reports.soak_report import SoakReport, idle, render, summarize
from asynchicache.bench.soak_config import SoakConfig

__all__ = ["SoakConfig", "SoakReport", "build_parser", "main", "render", "run_soak"]


async def _monitor(
    watch: ServerWatch, http: httpx.AsyncClient, cfg: SoakConfig, t0: float,
    samples: list[ServerSample], stats: list[dict[str, Any]], stop: asyncio.Event,
) -> None:  # fmt: skip
    while not stop.is_set():
        samples.append(watch.sample(time.monotonic() - t0))
        try:
            r = await http.get("/cache/stats", timeout=30)
            if r.status_code == 200:
                stats.append({"t": samples[-1].t, **_pool_view(r.json())})
        except httpx.HTTPError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), cfg.sample_s)


def _pool_view(stats: dict[str, Any]) -> dict[str, Any]:
    cache = stats.get("cache") or {}
    return {
        "queues": stats.get("queues"),
        "device": cache.get("device"),
        "host": cache.get("host"),
        "page_bytes": cache.get("page_bytes"),
    }


async def _drain(http: httpx.AsyncClient, cfg: SoakConfig) -> dict[str, Any]:
    """Wait until nothing is queued or in use, then ask for the integrity check."""
    deadline = time.monotonic() + cfg.drain_timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = await http.get("/cache/stats", params={"integrity": "true"}, timeout=60)
        if r.status_code == 429:  # integrity scans run at most once a second
            await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
            continue
        r.raise_for_status()
        stats = r.json()
        if idle(stats):
            break
        await asyncio.sleep(0.5)
    return stats


async def run_soak(cfg: SoakConfig) -> SoakReport:
    """Drive the clients for `cfg.duration_s`, then drain and check the server."""
    watch = ServerWatch.for_port(cfg.port)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.clients + 4, max_keepalive_connections=cfg.clients)
    tally, samples, stats = Tally(), list[Any](), list[Any]()
    prompts = make_prompts(cfg.prompts, cfg.seed, cfg.prefix_lines, cfg.prefixes)
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=cfg.request_timeout_s, limits=limits
    ) as http:
        t0 = time.monotonic()
        stop = asyncio.Event()
        monitor = asyncio.create_task(_monitor(watch, http, cfg, t0, samples, stats, stop))
        deadline = t0 + cfg.duration_s
        await asyncio.gather(
            *(client_loop(i, http, cfg, prompts, tally, deadline) for i in range(cfg.clients))
        )
        seconds = time.monotonic() - t0
        final = await _drain(http, cfg)
        samples.append(watch.sample(time.monotonic() - t0))
        stop.set()
        await monitor
    return summarize(cfg, tally, samples, stats, final, seconds)


def build_parser() -> argparse.ArgumentParser:
    d = SoakConfig(url="http://127.0.0.1:8000")
    p = argparse.ArgumentParser(prog="asynchicache bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=d.url, help="server base URL (default %(default)s)")
    p.add_argument("--clients", type=int, default=d.clients, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per answer")
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate,
                   help="share of requests abandoned mid-stream on purpose")  # fmt: skip
    p.add_argument("--prompts", type=int, default=d.prompts, help="distinct prompts")
    p.add_argument("--prefix-lines", type=int, default=d.prefix_lines,
                   help="lines of each shared system prefix (~21 tokens each)")  # fmt: skip
    p.add_argument("--prefixes", type=int, default=d.prefixes,
                   help="distinct shared prefixes (raise it to churn L2/L3)")  # fmt: skip
    p.add_argument("--sample-interval", type=float, default=d.sample_s, help="seconds")
    p.add_argument("--warmup", type=float, help="seconds before memory must stay flat")
    p.add_argument("--api-key", help="bearer token, when the server wants one")
    p.add_argument("--seed", type=int, default=d.seed)
    add_output_arguments(p, "soak.json (with the timeline)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = SoakConfig(
            url=args.url.rstrip("/"), clients=args.clients, duration_s=args.duration,
            max_tokens=args.max_tokens, disconnect_rate=args.disconnect_rate,
            prompts=args.prompts, prefix_lines=args.prefix_lines, prefixes=args.prefixes,
            sample_s=args.sample_interval,
            warmup_s=args.warmup,
            api_key=args.api_key, seed=args.seed,
        )  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"asynchicache bench soak: {exc}") from exc
    report = asyncio.run(run_soak(cfg))
    record = asdict(report)
    write_report(args.out, "soak.json", record)
    print_report(args, record, render(report))
    if args.out is not None:
        print(f"report: {args.out / 'soak.json'}", file=sys.stderr)
    return 0 if report.passed else 1
