"""Prefetch at arrival against prefetch at admission: TTFT of disk hits under a burst.

    asynchicache bench prefetch [--clients 64] [--prefix-tokens 512] [--rounds 2]
        [--json] [--out DIR]

1. A server over a fresh disk folder computes `--clients` distinct long prefixes and
   stores them on disk, then stops: L1 and L2 go with it, the prefixes stay on disk.
2. Each round restarts a server over that folder once per mode, in turns (arrival:
   the default; admission: `--no-arrival-prefetch`), and sends `--clients` requests at
   once, each a stored prefix and a question of its own (`--question-tokens`, computed),
   streamed. A request whose
   usage names the disk as where its prefix came from is a disk hit; its time to first
   token counts. L1 admits a few requests at a time (`--max-running-requests`), so most
   wait in the queue: with arrival prefetch their reads overlap that wait. The disk is
   read with O_DIRECT (no page cache), so every run reads it for real; the defaults keep
   the disk's bandwidth short of the bottleneck (each request computes its question),
   which is where reading ahead can pay: a burst of prefixes larger than the disk can
   deliver in the time the engine computes is bound by the disk either way.

Prints (and with --out writes) JSON: p50/p90 TTFT of disk hits per mode, pooled over
the rounds, and `p90_ratio` = arrival p90 / admission p90 (lower is better); the same
over every request of the bursts (`every_request`: a read given up is recomputed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from asynchicache.bench.clients.client import exact_chat_body, stream_chat
from asynchicache.bench.processes.server_process import BenchServer
from asynchicache.bench.reports.output import (
    add_output_arguments,
    bench_parser,
    print_report,
    write_report,
)
from asynchicache.bench.workloads.text import question, text

REPORT = "prefetch.json"

MODES = {"arrival": (), "admission": ("--no-arrival-prefetch",)}


def _server_flags(args: argparse.Namespace, disk: Path) -> list[str]:
    return ["--device", args.device, "--disk-cache-dir", str(disk),
            "--device-cache-tokens", str(args.device_cache_tokens),
            "--host-cache-gb", str(args.host_cache_gb),
            "--max-running-requests", str(args.max_running_requests),
            *(["--model", args.model] if args.model else [])]  # fmt: skip


def _body(prefix: str, ask: str, max_tokens: int) -> dict:
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": ask}]
    return exact_chat_body(messages, max_tokens)


async def _burst(url: str, bodies: list[dict]) -> list[tuple[float, int]]:
    """(TTFT, prompt tokens read from disk) of each request, all sent at once."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:

        async def one(body: dict) -> tuple[float, int]:
            start = time.perf_counter()
            streamed = await stream_chat(client, body, start)
            usage = (streamed.usage or {}).get("prompt_tokens_details") or {}
            disk = int((usage.get("cached_tokens_by_tier") or {}).get("disk", 0))
            return streamed.first_s or float("inf"), disk

        return await asyncio.gather(*(one(b) for b in bodies))


def _wait_stored(server: BenchServer, timeout_s: float = 600.0) -> None:
    """Until the engine has no store pending (they start once it is idle)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cache = server.get_json("/cache/stats")["cache"]
        if cache["pending_storage"] == 0 and cache["pending_transfers"] == 0:
            return
        time.sleep(0.5)
    raise TimeoutError("stores still pending")


def _store_prefixes(args: argparse.Namespace, disk: Path, prefixes: list[str], log: Path) -> None:
    with BenchServer(_server_flags(args, disk), log) as server:
        rng = random.Random(1)
        for i in range(0, len(prefixes), 4):
            bodies = [_body(p, question(rng, 12), 1) for p in prefixes[i : i + 4]]
            asyncio.run(_burst(server.url, bodies))
        _wait_stored(server)


def _percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return {"n": len(values), "p50_s": statistics.median(values), "p90_s": q[8]}


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prefixes = [text(rng, args.prefix_tokens) for _ in range(args.clients)]
    with tempfile.TemporaryDirectory(prefix="asynchicache-prefetch-") as tmp:
        work = args.work_dir or Path(tmp)  # --work-dir: the folder and logs stay
        disk, logs = work / "kv", work
        work.mkdir(parents=True, exist_ok=True)
        _store_prefixes(args, disk, prefixes, logs / "store.log")
        ttfts: dict[str, list[float]] = {mode: [] for mode in MODES}
        every: dict[str, list[float]] = {mode: [] for mode in MODES}  # hits or not
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                bodies = [_body(p, question(rng, args.question_tokens), args.max_tokens)
                          for p in prefixes]  # fmt: skip
                flags = [*_server_flags(args, disk), *MODES[mode]]
                with BenchServer(flags, logs / f"{mode}-{r}.log") as server:
                    results = asyncio.run(_burst(server.url, bodies))
                ttfts[mode] += [t for t, from_disk in results if from_disk > 0]
                every[mode] += [t for t, _ in results]
    out: dict = {mode: _percentiles(values) for mode, values in ttfts.items()}
    a, b = out["arrival"].get("p90_s"), out["admission"].get("p90_s")
    out["p90_ratio"] = a / b if a and b else None
    # A read admission gave up on is recomputed: no disk hit, but the burst's time all the
    # same, so every request's TTFT is reported too.
    out["every_request"] = {mode: _percentiles(values) for mode, values in every.items()}
    a, b = (out["every_request"][m].get("p90_s") for m in MODES)
    out["every_request"]["p90_ratio"] = a / b if a and b else None
    out["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("asynchicache bench prefetch", __doc__)
    p.add_argument("--clients", type=int, default=64, help="requests per burst (default 64)")
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=512,
        help="tokens of each stored prefix (default 512)",
    )
    p.add_argument(
        "--question-tokens",
        type=int,
        default=256,
        help="tokens of each request's own question, computed after its prefix (default 256)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated (default 16)")
    p.add_argument("--rounds", type=int, default=2, help="bursts per mode (default 2)")
    p.add_argument("--max-running-requests", type=int, default=8, help="default 8")
    p.add_argument("--device-cache-tokens", type=int, default=16384, help="L1 (default 16384)")
    p.add_argument("--host-cache-gb", type=float, default=1.0, help="L2 (default 1.0)")
    p.add_argument("--device", default="cpu", help="default cpu")
    p.add_argument("--model", help="default: the embedded SmolLM2")
    p.add_argument("--seed", type=int, default=0)
    add_output_arguments(p, REPORT)
    p.add_argument(
        "--work-dir",
        type=Path,
        help="disk folder and server logs (default: a temporary folder, removed)",
    )
    return p  # fmt: skip


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    result = json.loads(json.dumps(run(args), default=str))  # paths as text
    write_report(args.out, REPORT, result)
    print_report(args, result, json.dumps(result, indent=2))
    return 0
