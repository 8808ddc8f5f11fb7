"""`asynchicache bench pressure`: every TTFT percentile under memory pressure, four servers.

    asynchicache bench pressure --out DIR [--clients 4,16] [--working-set 2.5]
        [--l1-tokens 16384] [--prefix-tokens 1000] [--suffix-tokens 32] [--repeats 4]
        [--max-tokens 16] [--threads N] [--arms ours,ours-l1,vllm,vllm-ours]
        [--client vllm|ours] [--vllm-python .venv-vllm/bin/python] [--plot PNG]

The workload (`bench/workloads/pressure_workload.py`): ~`--prefix-tokens` shared prefixes
whose KV is `--working-set` times L1, each asked `--repeats` times with a short
suffix, shuffled, `--max-tokens` greedy tokens each (`ignore_eos`). For each
client count, one server at a time, each started fresh (its own disk folder)
and warmed up with two requests of an unrelated prompt of the same shape:

  ours       `asynchicache serve`, every tier (L1 of --l1-tokens, L2 and L3 at
             serve's defaults)
  ours-l1    `asynchicache serve --no-host-cache --no-disk-cache`
  vllm       vLLM's OpenAI server alone, prefix caching on, `--l1-tokens` of KV
  vllm-ours  the same with our KV connector (`AsynchicacheConnector`, its cache
             service on a disk folder of the run)

Threads: vLLM computes on `--threads` OpenMP threads (default every core:
vLLM at its best here; `VLLM_CPU_NUM_OF_RESERVED_CPU` = cores - threads, the
same with and without the connector, bench/processes/vllm_process.py). Our server uses
its default thread policy (at most every core, `engine/threads.py`) unless
`--threads` is given, then `serve --threads N`. Both are written in the JSON.

Client (`--client`, bench/clients/pressure_client.py): `vllm` (default) times every
arm with vLLM's own serving benchmark code (`vllm.benchmarks.serve`, run by
`--vllm-python`), so our server is measured by vLLM's yardstick, not one of
ours; `ours` is an httpx client of the same behaviour for machines without vLLM.

Writes DIR/pressure.json (per client count and arm: requests/s, output tokens/s,
TTFT mean/p50/p90/p99/max, end-to-end p50/p99, the server's hit counters; TTFT
percentiles of the first asks of a prefix, of the later asks and, for our arms,
of the requests whose prefix came from the cache (`by_class`); and every request
(`requests`), for our arms with its engine trace split into HTTP in, queue, load
(the load's own submit-to-done time beside it: an L2 -> L1 copy, or a storage
read and the copy), wait, steps and HTTP out, the slowest ten again in `slowest`)
and a TTFT CDF plot (`--plot`, default DIR/pressure_ttft_cdf.png), all requests
and the later asks of a prefix per arm.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from asynchicache.bench.clients.pressure_client import CLIENTS, ClientRun
from asynchicache.bench.compare import DEFAULT_VLLM_PYTHON, _model
from asynchicache.bench.connector_hits import connector_counters
from asynchicache.bench.processes.peers import SERVED_NAME, Peer, ours, vllm
from asynchicache.bench.processes.server_process import BenchServer, ServerError, start_server_bench
from asynchicache.bench.processes.vllm_process import CONNECTOR_MODULE, VllmThreads, metric_sum
from asynchicache.bench.reports import pressure_report as report
from asynchicache.bench.reports.output import add_output_arguments, bench_parser, print_report
from asynchicache.bench.sweep import machine
from asynchicache.bench.workloads import conversation_workload as conversation
from asynchicache.bench.workloads.pressure_workload import (
    PressureParams,
    PressureWorkload,
    build,
    warm_up_prompt,
)
from asynchicache.common.shm import remove_stale_segments
from asynchicache.settings.config_flags import add_config_flags, config_kwargs

log = logging.getLogger(__name__)

AnyWorkload = PressureWorkload | conversation.ConversationWorkload

ARMS = ("ours", "ours-l1", "vllm", "vllm-ours")
WORKLOADS = ("pressure", "conversation")  # conversation: bench/workloads/conversation_workload.py
REPORT = "pressure.json"
CLIENT_TIMEOUT_S = 4 * 3600.0


@dataclass(frozen=True)
class PressureOptions:
    out: Path
    model: Path
    params: PressureParams
    clients: tuple[int, ...] = (4, 16)
    arms: tuple[str, ...] = ARMS
    client: str = "vllm"
    vllm_python: Path = DEFAULT_VLLM_PYTHON
    threads: int | None = None  # None: vLLM on every core, ours by its own policy
    plot: Path | None = None
    ours_args: tuple[str, ...] = ()
    vllm_args: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    work_dir: Path | None = None
    workload: str = "pressure"
    sessions: int = conversation.ConversationParams.sessions  # --workload conversation

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {WORKLOADS}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
        if not self.clients or min(self.clients) <= 0:
            raise ValueError(f"--clients must be positive counts, got {self.clients}")
        if self.client not in CLIENTS:
            raise ValueError(f"--client must be one of {CLIENTS}")
        VllmThreads.of(self.threads)  # raises on a count outside [1, cores]


def _kv_bytes_per_token(model: Path) -> int:
    from asynchicache.launch.frontend import load_frontend

    return load_frontend(str(model)).kv_bytes_per_token("float32")


def arm_peer(opts: PressureOptions, arm: str) -> Peer:
    """The command line of `arm` ({port} and {disk} filled in when it starts)."""
    l1 = str(opts.params.l1_tokens)
    if arm.startswith("ours"):
        threads = () if opts.threads is None else ("--threads", str(opts.threads))
        tiers = ("--no-host-cache", "--no-disk-cache") if arm == "ours-l1" else ()
        flags = ("--device-cache-tokens", l1, "--log-level", "info", *threads, *tiers)
        return dataclasses.replace(ours([*flags, *opts.ours_args]), name=arm)
    extra = list(opts.vllm_args)
    if arm == "vllm-ours":
        config = {
            "kv_connector": "AsynchicacheConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "disk_cache_dir": "{disk}/kv",
                "cache_service": "ipc://{disk}/cache.sock",
            },
        }
        extra += ["--kv-transfer-config", json.dumps(config)]
    kv_bytes = opts.params.l1_tokens * _kv_bytes_per_token(opts.model)
    peer = vllm(opts.vllm_python.absolute(), kv_bytes, extra, VllmThreads.of(opts.threads))
    return dataclasses.replace(peer, name=arm)


@contextlib.contextmanager
def _serving(opts: PressureOptions, peer: Peer, log_path: Path) -> Iterator[BenchServer]:
    disk = Path(tempfile.mkdtemp(prefix="asynchicache-pressure-", dir=opts.work_dir))
    server = peer.server(opts.model, disk, log_path, opts.startup_timeout_s)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if peer.name.startswith("vllm"):  # its engine core killed at shutdown leaves its L2
            remove_stale_segments()
        shutil.rmtree(disk, ignore_errors=True)


def _warm_up(url: str, workload: AnyWorkload, prompt: list[int]) -> None:
    """Two requests of a prompt no run uses, shaped like the run's (first shapes are slow)."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": workload.params.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    for _ in range(2):
        httpx.post(url + "/v1/completions", json=body, timeout=900).raise_for_status()


def _client_run(
    opts: PressureOptions, url: str, prompts_file: Path, c: int, out: Path
) -> ClientRun:
    python = str(opts.vllm_python.absolute()) if opts.client == "vllm" else sys.executable
    argv = [
        python, "-m", "asynchicache.bench.clients.pressure_client",
        "--requests", str(prompts_file), "--url", url, "--concurrency", str(c),
        "--max-tokens", str(opts.params.max_tokens), "--client", opts.client, "--out", str(out),
    ]  # fmt: skip
    with (out.with_suffix(".log")).open("wb") as log_file:
        subprocess.run(
            argv, check=True, stdout=log_file, stderr=subprocess.STDOUT, timeout=CLIENT_TIMEOUT_S
        )
    return ClientRun.from_json(json.loads(out.read_text()))


def _server_counters(arm: str, server: BenchServer) -> dict[str, Any]:
    """What the server says it served: our engine's stats, or vLLM's prefix cache counters."""
    if arm.startswith("ours"):
        stats = server.get_json("/cache/stats?traces=true")
        keep = ("computed_prompt_tokens", "preemptions", "loads_given_up", "loads_deferred")
        out = {k: stats.get(k) for k in keep}
        out["request_traces"] = stats.get("request_traces", {})
        out["traces"] = stats.get("traces", [])
        counters = (stats.get("cache") or {}).get("counters") or {}
        out["hit_tokens"] = {k: v for k, v in counters.items() if k.endswith("_hit_tokens")}
        return out
    text = httpx.get(server.url + "/metrics", timeout=60).text
    metrics = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                metrics[name] = float(value)
    names = (
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
    )
    out = {n.removeprefix("vllm:"): metric_sum(metrics, n) for n in names}
    return {**out, **connector_counters(metrics)}


def _measure(
    opts: PressureOptions, workload: AnyWorkload, arm: str, c: int, warm: list[int]
) -> tuple[ClientRun, dict[str, Any]]:
    folder = opts.out / f"c{c}" / arm
    folder.mkdir(parents=True, exist_ok=True)
    prompts_file = folder / "prompts.json"
    prompts_file.write_text(json.dumps([list(r.prompt) for r in workload.requests]))
    with _serving(opts, arm_peer(opts, arm), folder / "server.log") as server:
        _warm_up(server.url, workload, warm)
        load = os.getloadavg()[0]
        run = _client_run(opts, server.url, prompts_file, c, folder / "client.json")
        counters = _server_counters(arm, server)
    result: dict[str, Any] = {
        "figures": report.figures(run),
        "server": {k: v for k, v in counters.items() if k not in ("request_traces", "traces")},
        "load_avg_1m": {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)},
    }
    if arm.startswith("ours"):
        result["engine_phases"] = {
            k: v for k, v in (counters.get("request_traces") or {}).items() if k != "slowest"
        }
    prefixes = [r.prefix for r in workload.requests]
    rows = report.request_rows(run, counters.get("traces") or [], prefixes)
    result["by_class"] = report.by_class(rows, workload.params.prefix_tokens)
    result["slowest"] = report.slow_requests(rows)
    result["requests"] = rows  # every request, with its engine trace where ours
    prompt_tokens = sum(len(r.prompt) for r in workload.requests)
    computed = counters.get("computed_prompt_tokens")
    if isinstance(computed, int | float) and prompt_tokens:
        result["computed_token_ratio"] = round(computed / prompt_tokens, 4)
    return run, result


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """ours against the others: requests/s (above 1 favours ours) and TTFT p90/p99 (below 1)."""
    figs = {arm: r["figures"] for arm, r in results.items()}
    out = {}
    for other in ("vllm", "vllm-ours", "ours-l1"):
        if "ours" not in figs or other not in figs:
            continue
        for key in ("req_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
            a, b = figs["ours"].get(key), figs[other].get(key)
            if a is not None and b:
                out[f"ours/{other}:{key}"] = round(a / b, 4)
        # The later asks of a prefix (the hits, where a tier kept it) apart.
        ours_hits = results["ours"].get("by_class", {}).get("repeat", {})
        other_hits = results[other].get("by_class", {}).get("repeat", {})
        for key in ("ttft_p90_s", "ttft_p99_s"):
            a, b = ours_hits.get(key), other_hits.get(key)
            if a is not None and b:
                out[f"ours/{other}:repeat_{key}"] = round(a / b, 4)
    if "vllm-ours" in figs and "vllm" in figs:
        for key in ("req_s", "ttft_p90_s", "ttft_p99_s"):
            a, b = figs["vllm-ours"].get(key), figs["vllm"].get(key)
            if a is not None and b:
                out[f"vllm-ours/vllm:{key}"] = round(a / b, 4)
    return out


def _tokenizer(opts: PressureOptions) -> Any:
    from asynchicache.bench.workloads.prompts import load_tokenizer

    return load_tokenizer(str(opts.model))


def _workload(opts: PressureOptions, tokenizer: Any) -> tuple[AnyWorkload, list[int]]:
    """The run's requests and its warm-up prompt (`--workload`)."""
    if opts.workload == "conversation":
        p = opts.params
        params = conversation.ConversationParams(
            l1_tokens=p.l1_tokens, sessions=opts.sessions, max_tokens=p.max_tokens, seed=p.seed
        )
        return conversation.build(params, tokenizer), conversation.warm_up_prompt(params, tokenizer)
    return build(opts.params, tokenizer), warm_up_prompt(opts.params, tokenizer)


def run(opts: PressureOptions) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(opts)
    workload, warm = _workload(opts, tokenizer)
    threads = VllmThreads.of(opts.threads)
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": str(opts.model),
        "workload": workload.describe(),
        "settings": {
            "clients": list(opts.clients),
            "arms": list(opts.arms),
            "client": opts.client,
            "vllm_threads": threads.describe(),
            "ours_threads": opts.threads
            if opts.threads is not None
            else f"serve's default policy (at most {threads.cores})",
        },
        "commands": {arm: arm_peer(opts, arm).shell() for arm in opts.arms},
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "results": {},
        "ratios": {},
        "failed": {},
    }
    runs: dict[int, dict[str, ClientRun]] = {}
    for c in opts.clients:
        runs[c], record["results"][str(c)] = {}, {}
        for arm in opts.arms:
            log.info("%d clients: %s", c, arm)
            try:
                run_, result = _measure(opts, workload, arm, c, warm)
            except (ServerError, RuntimeError, OSError, httpx.HTTPError) as exc:
                log.error("%d clients, %s failed: %s", c, arm, exc)
                record["failed"][f"c{c}/{arm}"] = str(exc)[-2000:]
                continue
            except subprocess.CalledProcessError as exc:
                record["failed"][f"c{c}/{arm}"] = f"the client failed: {exc}"
                continue
            runs[c][arm], record["results"][str(c)][arm] = run_, result
        record["ratios"][str(c)] = _ratios(record["results"][str(c)])
    plot = opts.plot or opts.out / "pressure_ttft_cdf.png"
    w = workload.describe()
    notes = (
        f"{workload.notes()}; vLLM on {threads.threads} threads; client: {opts.client}"
        if isinstance(workload, conversation.ConversationWorkload)
        else f"{w['num_prefixes']} prefixes x {w['repeats']} of {w['prefix_tokens']}+"
        f"{w['suffix_tokens']} tokens, working set {w['working_set']}x L1 "
        f"({w['l1_tokens']} tokens), {w['max_tokens']} output tokens; vLLM on "
        f"{threads.threads} threads; client: {opts.client}"
    )
    prefixes = [r.prefix for r in workload.requests]
    report.plot_cdf(runs, plot, "bench pressure: TTFT CDF", notes, prefixes)
    record["plot"] = str(plot)
    (opts.out / REPORT).write_text(json.dumps(record, indent=2) + "\n")
    return record


# ------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = bench_parser("asynchicache bench pressure", __doc__)
    add_output_arguments(p, REPORT, out_required=True)
    p.add_argument("--model", type=Path, help="HF folder (default: SmolLM2 exported to OUT)")
    p.add_argument("--clients", default="4,16", help="client counts (default %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help="servers to run (default %(default)s)")
    p.add_argument("--client", choices=CLIENTS, default="vllm", help="(default %(default)s)")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads of every server (default: vLLM on every core, ours by "
        "its own policy, at most every core)",
    )
    p.add_argument("--plot", type=Path, help="the CDF's PNG (default OUT/pressure_ttft_cdf.png)")
    add_config_flags(p, PressureParams, {
        "--l1-tokens": "device KV of every server, in tokens",
        "--working-set": "the prefix set's KV over L1",
        "--prefix-tokens": "tokens of each shared prefix",
        "--suffix-tokens": "tokens of each request's own suffix",
        "--repeats": "requests per prefix",
        "--max-tokens": "output tokens per request",
        "--seed": "prompt text and order",
    })  # fmt: skip
    p.add_argument("--ours-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--work-dir", type=Path, help="where disk cache folders go (default: tmp)")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="pressure",
        help="pressure: shuffled repeats of --prefix-tokens prefixes; conversation: "
        "multi-turn sessions (bench/workloads/conversation_workload.py; of the workload flags "
        "it takes --l1-tokens, --max-tokens and --seed)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=conversation.ConversationParams.sessions,
        help="conversations of --workload conversation (default %(default)s)",
    )
    return p


def options_from_args(args: argparse.Namespace) -> PressureOptions:
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    needs_vllm = any(a.startswith("vllm") for a in arms) or args.client == "vllm"
    model = _model(args.model, args.out, hf_needed=needs_vllm)
    if needs_vllm and not args.vllm_python.exists():
        raise ValueError(
            f"--vllm-python {args.vllm_python} does not exist (vLLM's arms and client need it; "
            "or --arms ours,ours-l1 --client ours)"
        )
    return PressureOptions(
        out=args.out,
        model=model.absolute(),
        params=PressureParams(**config_kwargs(PressureParams, args)),
        clients=tuple(int(c) for c in args.clients.split(",") if c.strip()),
        arms=arms,
        client=args.client,
        vllm_python=args.vllm_python,
        threads=args.threads,
        plot=args.plot,
        ours_args=tuple(args.ours_arg),
        vllm_args=tuple(args.vllm_arg),
        startup_timeout_s=args.startup_timeout,
        work_dir=args.work_dir,
        workload=args.workload,
        sessions=args.sessions,
    )


def _view(record: dict[str, Any]) -> str:
    lines = [f"bench pressure: {record['workload']['requests']} requests per run"]
    lines.append(
        "| clients | arm | req/s | TTFT mean | p50 | p90 | p99 | repeats p90 | p99 "
        "| fully cached p90 |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, arms in record["results"].items():
        for arm, r in arms.items():
            f = r["figures"]
            cells = [f.get(k) for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")]
            classes = r.get("by_class", {})
            repeat, cached = classes.get("repeat", {}), classes.get("fully_cached", {})
            cells += [repeat.get("ttft_p90_s"), repeat.get("ttft_p99_s")]
            cells.append(cached.get("ttft_p90_s"))
            shown = " | ".join("-" if v is None else f"{v:.2f}" for v in cells)
            lines.append(f"| {c} | {arm} | {f['req_s']:.2f} | {shown} |")
    lines.append(json.dumps({"ratios": record["ratios"], "failed": record["failed"]}, indent=2))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args, opts = start_server_bench("pressure", _parser(), argv, options_from_args)
    record = run(opts)
    print_report(args, record, _view(record))
    return 1 if record["failed"] else 0
