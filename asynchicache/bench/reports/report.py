"""A sweep's markdown table and plots (matplotlib, Agg backend: no display needed).

One figure per question a reader asks:

    ttft.png             how long until the first token, per configuration? (CDF)
    tokens_by_tier.png   where did the prompt tokens come from, against the ideal?
    throughput.png       how many requests and tokens per second did each serve?
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on servers and in CI
import matplotlib.pyplot as plt

from asynchicache.bench.reports.run_results import read_results
from asynchicache.common.tiers import TIERS

TIER_LABELS = {"device": "L1 device", "host": "L2 host", "disk": "L3 disk", "remote": "L4 remote"}
TIER_COLORS = {"device": "#1b9e77", "host": "#7570b3", "disk": "#d95f02", "remote": "#e7298a"}
COMPUTED_COLOR = "#bdbdbd"
FIGSIZE = (7.5, 4.2)
DPI = 100

Configs = Mapping[str, Mapping[str, Any]]


# ---------------------------------------------------------------------- table
def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return _fmt(100 * x, 1) + "%"


def config_table(configs: Configs, reference: str = "L1") -> str:
    """One row per configuration; 'TTFT / L1' compares mean TTFTs with the L1-only row."""
    ref = configs.get(reference, {}).get("mean_ttft_s")
    head = (
        "| configuration | mean TTFT (s) | p50 | p90 | p99 | TTFT / L1 | hit rate | ideal | "
        "L1 | L2 | L3 | L4 | req/s | tokens/s | prefill tok/s | preemptions | errors |"
    )
    rows = [head, "|" + "---|" * 17]
    for name, c in configs.items():
        tiers = c["hit_rate_by_tier"]
        ratio = _fmt(c["mean_ttft_s"] / ref) + "x" if ref else "n/a"
        rows.append(
            f"| {name} | {_fmt(c['mean_ttft_s'])} | {_fmt(c['p50_ttft_s'])} | "
            f"{_fmt(c['p90_ttft_s'])} | {_fmt(c['p99_ttft_s'])} | {ratio} | "
            f"{_pct(c['hit_rate'])} | {_pct(c['ideal_hit_rate'])} | "
            + " | ".join(_pct(tiers.get(t, 0.0)) for t in TIERS)
            + f" | {_fmt(c['requests_per_s'], 3)} | {_fmt(c['total_tokens_per_s'], 1)} | "
            f"{_fmt(c.get('engine_prefill_tok_s'), 0)} | {_preemptions(c)} | "
            f"{c['errors']}/{c['requests']} |"
        )
    return "\n".join(rows) + "\n"


def _preemptions(c: Mapping[str, Any]) -> str:
    """'N (x/req)', flagged when the rate is a storm (bench.sweep.preemption_rate)."""
    n, rate = c.get("preemptions"), c.get("preemptions_per_request")
    if n is None or rate is None:
        return "n/a" if n is None else str(n)
    return f"{n} ({rate:.3f}/req{', STORM' if c.get('preemption_storm') else ''})"


TABLE_NOTES = (
    "TTFT / L1: mean TTFT over the L1-only row's. Hit rate: cached prompt tokens / prompt "
    "tokens, as the server reported them (L1..L4: the share from each tier); ideal: the same "
    "requests replayed through an unbounded page cache. prefill tok/s: the engine's running "
    "estimate of its prefill speed, a gauge of how busy the machine was during that run. "
    "Preemptions: the engine's, per request (a STORM above 0.05 per request)."
)


def _load_notes(configs: Configs) -> list[str]:
    """One line per setup whose engine recomputed a prefix it had found in a lower tier."""
    notes = []
    for name, c in configs.items():
        ev = c.get("load_events") or {}
        if not (ev.get("late_loads") or ev.get("short_loads") or ev.get("failed_stores")):
            continue
        why = ", ".join(f'{n}x "{r}"' for r, n in ev.get("reasons", {}).items())
        notes.append(
            f"- {name}: {ev.get('late_loads', 0)} loads given up as late, "
            f"{ev.get('short_loads', 0)} short loads, {ev.get('failed_stores', 0)} "
            f"failed stores{': ' + why if why else ''}"
        )
    return [*notes, ""] if notes else []


def markdown(summary: Mapping[str, Any]) -> str:
    s = summary["sizing"]
    lines = [
        f"Workload `{summary['workload']}` (seed {summary['seed']}, scale {summary['scale']}, "
        f"{summary['requests']} requests), {summary['date']}.",
        "",
        f"Working set {s['working_set_tokens']} tokens (distinct full prompt pages) = "
        f"{_fmt(s['working_set_over_l1'], 1)}x L1; L1 {s['device_cache_tokens']} tokens, "
        f"L2 {s['host_cache_tokens']} tokens, page {s['page_size']} tokens.",
        "",
        config_table(summary["configs"]),
        TABLE_NOTES,
        "",
    ]
    lines += _load_notes(summary["configs"])
    if summary.get("before_restart"):
        lines += [
            "Before the restart (the run that filled the persistent tiers):",
            "",
            config_table(summary["before_restart"]),
        ]
    for name, why in summary.get("failed", {}).items():
        lines.append(f"**{name} failed**: `{why.splitlines()[-1] if why else ''}`")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- plots
def _ttft_values(out_dir: Path, config: Mapping[str, Any]) -> list[float]:
    path = out_dir / config["setup"] / "results.jsonl"
    if not path.exists():
        return []
    return sorted(r.ttft_s for r in read_results(path) if r.ok and r.ttft_s is not None)


def plot_ttft(out_dir: Path, configs: Configs, title: str) -> Path:
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for name, c in configs.items():
        xs = _ttft_values(out_dir, c)
        if not xs:
            continue
        ys = [100 * (i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (mean {c['mean_ttft_s']:.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("requests with at most this TTFT (%)")
    ax.set_ylim(0, 101)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{title}: time to first token, per configuration")
    return _save(fig, out_dir / "ttft.png")


def plot_tokens_by_tier(out_dir: Path, configs: Configs, title: str) -> Path:
    names = list(configs)
    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=FIGSIZE)
    bottoms = [0.0] * len(names)
    for tier in TIERS:
        shares = [100 * configs[n]["hit_rate_by_tier"].get(tier, 0.0) for n in names]
        if not any(shares) and tier == "remote":
            continue
        ax.bar(xs, shares, bottom=bottoms, color=TIER_COLORS[tier], label=TIER_LABELS[tier])
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    ax.bar(
        xs,
        [100 - b for b in bottoms],
        bottom=bottoms,
        color=COMPUTED_COLOR,
        label="computed (prefill)",
    )
    ideal = [100 * configs[n]["ideal_hit_rate"] for n in names]
    ax.hlines(
        ideal,
        [x - 0.4 for x in xs],
        [x + 0.4 for x in xs],
        colors="black",
        linestyles="--",
        linewidth=1.5,
        label="ideal (unbounded cache)",
    )
    labels = [f"{n}\n{hit:.0f}% cached" for n, hit in zip(names, bottoms, strict=True)]
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("share of prompt tokens (%)")
    ax.set_xlabel("configuration")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{title}: where prompt tokens came from")
    return _save(fig, out_dir / "tokens_by_tier.png")


def _bars(ax: Any, names: list[str], values: list[float], ylabel: str, fmt: str) -> None:
    bars = ax.bar(names, values, color="#4c72b0")
    # Inside the bars: clear of a reference line drawn near their tops.
    ax.bar_label(
        bars, labels=[fmt.format(v) for v in values], fontsize=8, label_type="center", color="white"
    )
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.margins(y=0.15)


def plot_throughput(
    out_dir: Path, configs: Configs, title: str, offered_rate: float | None
) -> Path:
    names = list(configs)
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE)
    _bars(left, names, [configs[n]["requests_per_s"] for n in names], "requests / s", "{:.2f}")
    if offered_rate:
        left.axhline(
            offered_rate,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"offered {offered_rate:g} req/s",
        )
        left.legend(fontsize=7, loc="lower right")
    _bars(
        right,
        names,
        [configs[n]["total_tokens_per_s"] for n in names],
        "prompt + output tokens served / s",
        "{:.0f}",
    )
    fig.suptitle(f"{title}: throughput over the whole run")
    return _save(fig, out_dir / "throughput.png")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_report(out_dir: Path, summary: Mapping[str, Any]) -> list[Path]:
    """table.md and the three plots under `out_dir`; returns the files written."""
    (out_dir / "table.md").write_text(markdown(summary))
    configs = summary["configs"]
    written = [out_dir / "table.md"]
    if not configs:
        return written
    title = summary["workload"]
    if title == "restart":
        title = f"restart of {summary.get('base_workload', '?')}, after the restart"
    rate = summary.get("params", {}).get("rate")
    written += [
        plot_ttft(out_dir, configs, title),
        plot_tokens_by_tier(out_dir, configs, title),
        plot_throughput(out_dir, configs, title, rate),
    ]
    return written
