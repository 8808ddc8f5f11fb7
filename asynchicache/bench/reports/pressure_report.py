"""Figures of a `bench pressure` run: rates, TTFT percentiles, the slow requests' traces, a CDF.

Percentiles are nearest-rank over the successful requests (p99 of 164 requests
is the 163rd fastest). For our server's arms the slowest requests are lined
up with the engine's traces (`engine/trace.py`: both use CLOCK_MONOTONIC): a
trace belongs to a client request when the engine took it between the
request's start and its first token, with the same prompt length; the report
then splits each slow TTFT into the HTTP process's share (in and out) and the
engine's phases.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asynchicache.bench.clients.pressure_client import ClientRun, RequestTiming

SLOW_SHOWN = 10


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of an ascending, non-empty sequence."""
    rank = max(1, min(len(sorted_values), round(q * len(sorted_values) + 0.4999)))
    return sorted_values[rank - 1]


def figures(run: ClientRun) -> dict[str, Any]:
    """requests/s, output tokens/s and TTFT / latency percentiles of one run."""
    ok = [r for r in run.requests if r.ok]
    out: dict[str, Any] = {
        "requests": len(run.requests),
        "failed": len(run.requests) - len(ok),
        "duration_s": round(run.duration_s, 3),
        "req_s": round(len(ok) / run.duration_s, 4) if run.duration_s > 0 else 0.0,
        "output_tok_s": round(sum(r.output_tokens for r in ok) / run.duration_s, 2)
        if run.duration_s > 0
        else 0.0,
    }
    if not ok:
        return out
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    e2e = sorted(r.latency for r in ok if r.latency is not None)
    out["ttft_mean_s"] = round(statistics.fmean(ttft), 4)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        out[f"ttft_{name}_s"] = round(percentile(ttft, q), 4)
    out["ttft_max_s"] = round(ttft[-1], 4)
    out["e2e_p50_s"] = round(percentile(e2e, 0.5), 4)
    out["e2e_p99_s"] = round(percentile(e2e, 0.99), 4)
    errors = sorted({r.error for r in run.requests if r.error})
    if errors:
        out["errors"] = [e[-300:] for e in errors[:5]]
    return out


def match_traces(
    timings: Sequence[RequestTiming], traces: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any] | None]:
    """The engine trace of each request (None where none fits), each trace used once.

    A trace fits a request when its prompt has the request's length, it arrived
    between the request's send and first token, and its first token (where traced)
    came no later than the client saw one. Prompts of one length sent together are
    told apart by their first tokens: requests take traces in the order their
    clients saw first tokens, each the fitting trace whose first token came last
    (the engine's first tokens reach their clients in order, milliseconds later);
    without first tokens, the earliest arrival.
    """
    out: list[Mapping[str, Any] | None] = [None] * len(timings)
    used: set[int] = set()
    answered = [i for i, r in enumerate(timings) if r.ttft is not None]
    for i in sorted(answered, key=lambda i: timings[i].start + (timings[i].ttft or 0)):
        r = timings[i]
        end = r.start + (r.ttft or 0)
        fits = [
            j
            for j, t in enumerate(traces)
            if j not in used
            and t["prompt_tokens"] == r.prompt_tokens
            and r.start <= t["arrived"] <= end
            and (t.get("first_token") is None or t["first_token"] <= end)
        ]
        if fits:
            j = max(fits, key=lambda j: _latest_first_token(traces[j]))
            used.add(j)
            out[i] = traces[j]
    return out


def _latest_first_token(trace: Mapping[str, Any]) -> tuple[float, float]:
    first = trace.get("first_token")
    return (-math.inf if first is None else first, -trace["arrived"])


PHASES = ("queue_s", "load_s", "load_ticket_s", "wait_s", "step_s", "overhead_s", "max_step_s")
# A request whose cached tokens cover this share of its prefix is "fully cached".
FULLY_CACHED = 0.95


def _phases(r: RequestTiming, t: Mapping[str, Any]) -> dict[str, Any]:
    """A request's way to its first token: HTTP in, the engine's phases, HTTP out."""
    row: dict[str, Any] = {"http_in_s": round(t["arrived"] - r.start, 4)}
    if t.get("first_token") is not None:
        row["http_out_s"] = round(r.start + (r.ttft or 0) - t["first_token"], 4)
    for k in PHASES:
        row[k] = round(float(t.get(k, 0.0)), 4)
    row.update(
        steps=t["steps"],
        max_step_tokens=t["max_step_tokens"],
        computed_tokens=t["computed_tokens"],
        cached=t["cached"],
        load_pages={"host": t.get("load_host_pages", 0), "storage": t.get("load_storage_pages", 0)},
    )
    return row


def request_rows(
    run: ClientRun, traces: Sequence[Mapping[str, Any]], prefixes: Sequence[int]
) -> list[dict[str, Any]]:
    """Every request in send order: its prefix, whether it was that prefix's first ask,
    its TTFT and, where an engine trace matches it, the phases of that TTFT."""
    matched = match_traces(run.requests, traces)
    seen: set[int] = set()
    rows = []
    for i, (r, t) in enumerate(zip(run.requests, matched, strict=True)):
        row: dict[str, Any] = {
            "index": i,
            "prefix": prefixes[i],
            "first_ask": prefixes[i] not in seen,
            "ok": r.ok,
            "ttft_s": None if r.ttft is None else round(r.ttft, 4),
        }
        seen.add(prefixes[i])
        if t is not None:
            row.update(_phases(r, t))
        rows.append(row)
    return rows


def by_class(rows: Sequence[Mapping[str, Any]], prefix_tokens: int) -> dict[str, Any]:
    """TTFT percentiles of the first asks of a prefix (misses), of the later asks, and of
    the requests whose trace says their prefix came from the cache (`fully_cached`)."""
    classes = {
        "first_ask": [r for r in rows if r["first_ask"]],
        "repeat": [r for r in rows if not r["first_ask"]],
    }
    if any("cached" in r for r in rows):  # traced: our arms
        floor = FULLY_CACHED * prefix_tokens
        classes["fully_cached"] = [
            r for r in rows if "cached" in r and sum(r["cached"].values()) >= floor
        ]
    out: dict[str, Any] = {}
    for name, members in classes.items():
        ttft = sorted(r["ttft_s"] for r in members if r["ok"])
        if not ttft:
            continue
        out[name] = {"requests": len(ttft)}
        out[name].update({q: percentile(ttft, v) for q, v in PERCENTILES})
    return out


PERCENTILES = (("ttft_p50_s", 0.5), ("ttft_p90_s", 0.9), ("ttft_p99_s", 0.99))


def slow_requests(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The slowest requests by TTFT (`request_rows`), with their phases where traced."""
    ok = [r for r in rows if r["ok"]]
    return sorted(ok, key=lambda r: -(r["ttft_s"] or 0))[:SLOW_SHOWN]


def _repeats(prefixes: Sequence[int]) -> list[bool]:
    """Whether each request asks its prefix again (not its first ask)."""
    seen: set[int] = set()
    out = []
    for p in prefixes:
        out.append(p in seen)
        seen.add(p)
    return out


def plot_cdf(
    runs: Mapping[int, Mapping[str, ClientRun]],
    path: Path,
    title: str,
    notes: str,
    prefixes: Sequence[int],
) -> None:
    """One panel per client count: each arm's TTFT CDF (log time axis), all requests
    (solid) and the later asks of a prefix (dashed: the hits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(runs)
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    for ax, c in zip(axes[0], counts, strict=True):
        for n, (arm, run) in enumerate(runs[c].items()):
            ttft = sorted(r.ttft for r in run.requests if r.ok and r.ttft is not None)
            if not ttft:
                continue
            ys = [(k + 1) / len(ttft) for k in range(len(ttft))]
            label = f"{arm}: p50 {percentile(ttft, 0.5):.2f} s, p99 {percentile(ttft, 0.99):.2f} s"
            ax.step(ttft, ys, where="post", label=label, color=f"C{n}")
            hits = sorted(
                r.ttft for r, again in zip(run.requests, _repeats(prefixes), strict=True)
                if again and r.ok and r.ttft is not None
            )  # fmt: skip
            if hits:
                ys = [(k + 1) / len(hits) for k in range(len(hits))]
                label = f"{arm}, repeats: p90 {percentile(hits, 0.9):.2f} s"
                ax.step(hits, ys, where="post", label=label, color=f"C{n}", linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{c} clients")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, textwrap.fill(notes, 40 + 90 * len(counts)), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
