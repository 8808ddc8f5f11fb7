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

from asynchicache.bench.pressure_client import ClientRun, RequestTiming

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


def slow_requests(
    run: ClientRun, traces: Sequence[Mapping[str, Any]], prefixes: Sequence[int]
) -> list[dict[str, Any]]:
    """The slowest requests by TTFT, with their prefix and, where traced, its phases."""
    matched = match_traces(run.requests, traces)
    ranked = sorted(
        (i for i, r in enumerate(run.requests) if r.ok), key=lambda i: -(run.requests[i].ttft or 0)
    )
    out = []
    for i in ranked[:SLOW_SHOWN]:
        r, t = run.requests[i], matched[i]
        row: dict[str, Any] = {"index": i, "prefix": prefixes[i], "ttft_s": round(r.ttft or 0, 4)}
        if t is not None:
            row["http_in_s"] = round(t["arrived"] - r.start, 4)
            if t.get("first_token") is not None:
                row["http_out_s"] = round(r.start + (r.ttft or 0) - t["first_token"], 4)
            for k in ("queue_s", "load_s", "wait_s", "step_s", "overhead_s", "max_step_s"):
                row[k] = round(float(t[k]), 4)
            row.update(
                steps=t["steps"],
                max_step_tokens=t["max_step_tokens"],
                computed_tokens=t["computed_tokens"],
                cached=t["cached"],
            )
        out.append(row)
    return out


def plot_cdf(
    runs: Mapping[int, Mapping[str, ClientRun]], path: Path, title: str, notes: str
) -> None:
    """One panel per client count: each arm's TTFT CDF (log time axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(runs)
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    for ax, c in zip(axes[0], counts, strict=True):
        for arm, run in runs[c].items():
            ttft = sorted(r.ttft for r in run.requests if r.ok and r.ttft is not None)
            if not ttft:
                continue
            ys = [(k + 1) / len(ttft) for k in range(len(ttft))]
            label = f"{arm}: p50 {percentile(ttft, 0.5):.2f} s, p99 {percentile(ttft, 0.99):.2f} s"
            ax.step(ttft, ys, where="post", label=label)
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
