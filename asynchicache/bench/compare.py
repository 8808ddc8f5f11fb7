"""`asynchicache bench compare`: our server against vLLM (CPU) on the same model, side by side.

    asynchicache bench compare --out DIR [--model HF_DIR] [--vllm-python PATH]
                               [--peer-cmd 'NAME=COMMAND {port} ...'] [--rounds 3]

Every round starts each server in turn (never two at once; the order rotates
from round to round, so no server always runs first), and per server measures:

    startup_s              from spawning it until GET /v1/models answers
    ttft_cold_s            a ~1,557-token chat prompt it has never seen
    ttft_warm_s            the same prompt again (prefix cached)
    cN_tok_s, cN_mean_ttft_s, cN_p50_ttft_s, cN_p99_ttft_s
                           N clients (8, 32, 64) x --requests-per-client requests of
                           --max-tokens tokens each: completion tokens/s and TTFT
    ttft_restart_s         the long prompt again after a restart on the same disk folder

It prints one JSON object: the median of each figure over the rounds per
server, `ratios` (ours / peer for every figure: below 1 is better for ours on
times, above 1 on tokens/s), every round's figures with the CPU seconds each
process used, the exact commands, and the load average (figures only count on
a quiet machine). The same JSON goes to DIR/compare.json, server logs under
DIR/round-K/NAME/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from asynchicache.bench import compare_phases as phases
from asynchicache.bench.processes.peers import Peer, ours, parse_peer, vllm
from asynchicache.bench.processes.server_process import BenchServer, ServerError, start_server_bench
from asynchicache.bench.processes.vllm_process import VllmThreads
from asynchicache.bench.reports.output import add_output_arguments, bench_parser, print_report
from asynchicache.bench.sweep import machine
from asynchicache.settings.config_flags import add_config_flags, config_kwargs

log = logging.getLogger(__name__)

DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")


@dataclass(frozen=True)
class CompareOptions:
    out: Path
    model: Path  # a Hugging Face folder every server loads (or a GGUF, without vLLM)
    peers: tuple[Peer, ...]  # the first is the reference of the ratios (ours)
    rounds: int = 3
    clients: tuple[int, ...] = (8, 32, 64)
    requests_per_client: int = 2
    max_tokens: int = 64
    cold_prompt_tokens: int = 1557
    seed: int = 0
    startup_timeout_s: float = 900.0
    work_dir: Path | None = None  # where per-round disk folders go
    vllm_threads: VllmThreads | None = None  # None: no vLLM among the peers

    def __post_init__(self) -> None:
        if self.rounds <= 0 or self.requests_per_client <= 0 or self.max_tokens <= 0:
            raise ValueError("--rounds, --requests-per-client and --max-tokens must be positive")
        if not self.clients or min(self.clients) <= 0:
            raise ValueError(f"--clients must be positive counts, got {self.clients}")
        names = [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"peer names must differ, got {names}")


@dataclass
class _Round:
    """One round's figures per server (`figures`) and everything else (`details`)."""

    index: int
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)


@contextlib.contextmanager
def _running(
    opts: CompareOptions, peer: Peer, disk: Path, log_path: Path
) -> Iterator[tuple[BenchServer, float]]:
    """The started server and its start-up seconds; stopped on the way out."""
    server = peer.server(opts.model, disk, log_path, opts.startup_timeout_s)
    t0 = time.perf_counter()
    server.start()
    try:
        yield server, time.perf_counter() - t0
    finally:
        server.stop()


def _measure(opts: CompareOptions, peer: Peer, round_: int) -> tuple[dict[str, float], dict]:
    """Start `peer`, measure everything, restart it on the same disk folder, measure again."""
    out = opts.out / f"round-{round_}" / peer.name
    disk = Path(tempfile.mkdtemp(prefix="asynchicache-compare-", dir=opts.work_dir))
    long = phases.long_prompt(opts.seed * 1000 + round_, opts.cold_prompt_tokens)
    fig: dict[str, float] = {}
    det: dict[str, Any] = {"load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    try:
        with _running(opts, peer, disk, out / "server.log") as (server, fig["startup_s"]):
            phases.ttft(server.url, phases.short_prompt(round_))  # the first forward is slow
            cold = phases.ttft(server.url, long)
            warm = phases.ttft(server.url, long)
            fig["ttft_cold_s"], fig["ttft_warm_s"] = cold.seconds, warm.seconds
            det["long_prompt"] = {
                "prompt_tokens": cold.prompt_tokens,
                "cached_warm": warm.cached_tokens,
            }
            for n in opts.clients:
                seed = (opts.seed * 1000 + round_) * 1000 + n
                wl = phases.clients_workload(n, opts.requests_per_client, opts.max_tokens, seed)
                res = phases.throughput(server.url, server.proc.pid, wl, n)  # type: ignore[union-attr]
                for key in ("tok_s", "mean_ttft_s", "p50_ttft_s", "p99_ttft_s"):
                    fig[f"c{n}_{key}"] = res[key]
                det[f"c{n}"] = res
        with _running(opts, peer, disk, out / "server-restart.log") as (
            server,
            det["startup_restart_s"],
        ):
            phases.ttft(server.url, phases.short_prompt(round_ + 1))
            again = phases.ttft(server.url, long)
            fig["ttft_restart_s"] = again.seconds
            det["long_prompt"]["cached_restart"] = again.cached_tokens
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    det["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return fig, det


def _order(peers: Sequence[Peer], round_: int) -> list[Peer]:
    """Rotate the start order each round: every server goes first as often as the others."""
    k = round_ % len(peers)
    return [*peers[k:], *peers[:k]]


def medians(rounds: Sequence[_Round], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """The median of every figure over the rounds that measured it, per server."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        keys = {k for r in rounds for k in r.figures.get(name, {})}
        out[name] = {
            k: statistics.median(
                [r.figures[name][k] for r in rounds if k in r.figures.get(name, {})]
            )
            for k in sorted(keys)
        }
    return out


def ratios(median: dict[str, dict[str, float]], reference: str) -> dict[str, dict[str, float]]:
    """reference / peer for every figure both have (times: < 1 favours the reference)."""
    ref = median.get(reference, {})
    return {
        name: {k: ref[k] / v for k, v in figs.items() if k in ref and v}
        for name, figs in median.items()
        if name != reference
    }


def compare(opts: CompareOptions) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in opts.peers]
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": str(opts.model),
        "commands": {p.name: p.shell() for p in opts.peers},
        "settings": {
            "rounds": opts.rounds,
            "clients": list(opts.clients),
            "requests_per_client": opts.requests_per_client,
            "max_tokens": opts.max_tokens,
            "cold_prompt_tokens": opts.cold_prompt_tokens,
            "seed": opts.seed,
            "vllm_threads": opts.vllm_threads.describe() if opts.vllm_threads else None,
        },
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "failed": {},
    }
    rounds: list[_Round] = []
    for r in range(opts.rounds):
        rnd = _Round(r)
        for peer in _order(opts.peers, r):
            log.info("round %d: %s", r, peer.name)
            try:
                rnd.figures[peer.name], rnd.details[peer.name] = _measure(opts, peer, r)
            except (ServerError, RuntimeError, OSError, httpx.HTTPError) as exc:
                log.error("round %d, %s failed: %s", r, peer.name, exc)
                record["failed"][f"round-{r}/{peer.name}"] = str(exc)[-2000:]
        rounds.append(rnd)
    median = medians(rounds, names)
    record["median"] = median
    record["ratios"] = ratios(median, names[0])
    record["rounds"] = [
        {"round": r.index, "figures": r.figures, "details": r.details} for r in rounds
    ]
    loads = [
        d[k]
        for r in rounds
        for d in r.details.values()
        for k in ("load_avg_1m_at_start", "load_avg_1m_at_end")
    ]
    record["load_avg_1m_max"] = max(loads, default=None)
    (opts.out / "compare.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# ------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = bench_parser("asynchicache bench compare", __doc__)
    add_output_arguments(p, "compare.json (logs beside it)", out_required=True)
    p.add_argument(
        "--model",
        type=Path,
        help="Hugging Face folder all servers load, or a GGUF without vLLM "
        "(default: the embedded SmolLM2 GGUF exported to OUT/model-hf with "
        "`asynchicache model export-hf`)",
    )
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help="python of a venv with vLLM's CPU build (default %(default)s)",
    )
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out (e.g. ours vs peers)")
    p.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="vLLM's compute threads (VLLM_CPU_NUM_OF_RESERVED_CPU = cores - threads; "
        "default: every core, vLLM at its best on a small machine)",
    )
    p.add_argument(
        "--peer-cmd",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="another server: a command line with {port} (and {model}, {name}, {disk}); repeatable",
    )
    p.add_argument(
        "--ours-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to our `serve` (repeatable; --ours-arg=--threads=2)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to vLLM's api_server (repeatable)",
    )
    p.add_argument("--clients", default="8,32,64", help="client counts (default %(default)s)")
    add_config_flags(p, CompareOptions, {
        "--rounds": "rounds; figures are medians",
        "--requests-per-client": "requests each client sends in turn",
        "--max-tokens": "tokens per answer",
        "--cold-prompt-tokens": "length of the TTFT prompt",
        "--seed": "prompt text",
        "--startup-timeout": "seconds to wait for each server",
    })  # fmt: skip
    p.add_argument("--work-dir", type=Path, help="where disk cache folders go (default: tmp)")
    return p


def _model(arg: Path | None, out: Path, hf_needed: bool) -> Path:
    if arg is not None:
        if not arg.exists():
            raise ValueError(f"--model {arg} does not exist")
        if hf_needed and not (arg / "config.json").is_file():
            raise ValueError(f"--model {arg} is not a Hugging Face folder (vLLM needs one)")
        return arg
    folder = out / "model-hf"
    if not (folder / "config.json").is_file():
        try:
            from asynchicache.tools.export_hf import export_hf
        except ImportError as exc:
            raise ValueError(
                "give --model HF_FOLDER (this checkout has no model export-hf)"
            ) from exc
        export_hf(folder)
    return folder


def _l1_bytes(model: Path, ours_args: Sequence[str]) -> int:
    """The KV bytes of our L1 (--device-cache-tokens), the KV memory vLLM gets too."""
    from asynchicache.launch.frontend import load_frontend
    from asynchicache.launch.options import build_parser
    from asynchicache.settings.config import CacheConfig

    known, _ = build_parser().parse_known_args(list(ours_args))
    tokens = known.device_cache_tokens or CacheConfig.device_cache_tokens
    return tokens * load_frontend(str(model)).kv_bytes_per_token(known.dtype)


def options_from_args(args: argparse.Namespace) -> CompareOptions:
    model = _model(args.model, args.out, hf_needed=not args.no_vllm)
    peers = [ours(args.ours_arg)]
    threads = None
    if not args.no_vllm:
        if not args.vllm_python.exists():
            raise ValueError(
                f"--vllm-python {args.vllm_python} does not exist (a venv with "
                "vLLM's CPU build; or --no-vllm)"
            )
        threads = VllmThreads.of(args.vllm_threads)
        kv_bytes = _l1_bytes(model, args.ours_arg)
        peers.append(vllm(args.vllm_python.absolute(), kv_bytes, args.vllm_arg, threads))
    peers += [parse_peer(spec) for spec in args.peer_cmd]
    clients = tuple(int(c) for c in args.clients.split(",") if c.strip())
    return CompareOptions(
        **config_kwargs(
            CompareOptions,
            args,
            model=model.absolute(),
            peers=tuple(peers),
            clients=clients,
            vllm_threads=threads,
        )
    )


def main(argv: Sequence[str]) -> int:
    args, opts = start_server_bench("compare", _parser(), argv, options_from_args)
    record = compare(opts)
    headline = {
        k: record[k]
        for k in ("median", "ratios", "load_avg_1m_before", "load_avg_1m_max", "failed")
    }
    print_report(args, record, json.dumps(headline, indent=2))
    return 1 if record["failed"] else 0
