"""The soak's verdict: latency percentiles, memory and open files after the warm-up vs at
the end, shared memory against the L2 pool, restarts, the end state, and a summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asynchicache.bench.clients.soak_clients import Tally
from asynchicache.bench.processes.procwatch import ServerSample
from asynchicache.bench.soak_config import SoakConfig

MB = 1 << 20
# Flat means: after warm-up, private memory grows by less than this (absolute or relative).
FLAT_MB = 64
FLAT_SHARE = 0.05
FD_SLACK = 16


def idle(stats: dict[str, Any]) -> bool:
    cache = stats.get("cache") or {}
    queues = stats.get("queues") or {}
    in_use = [(cache.get(t) or {}).get("in_use", 0) for t in ("device", "host")]
    return not any(queues.values()) and not any(in_use) and not cache.get("pending_transfers")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _window_median(samples: list[ServerSample], lo: float, hi: float, field: str) -> float | None:
    vals = sorted(s.total(field) for s in samples if lo <= s.t <= hi)
    return float(vals[len(vals) // 2]) if vals else None


def _restarts(samples: list[ServerSample]) -> dict[str, int]:
    pids: dict[str, set[int]] = {}
    for s in samples:
        for p in s.procs:
            pids.setdefault(p.role, set()).add(p.pid)
    return {role: len(found) - 1 for role, found in pids.items()}


def _memory(samples: list[ServerSample], cfg: SoakConfig, end: float) -> dict[str, Any]:
    """Private memory and open files right after warm-up vs at the end (medians of windows)."""
    span = max(end - cfg.warmup, cfg.sample_s)
    early = (cfg.warmup, cfg.warmup + max(span / 5, cfg.sample_s))
    late = (end - max(span / 5, cfg.sample_s), end)
    out: dict[str, Any] = {}
    for name in ("anon", "rss", "open_files", "threads"):
        a = _window_median(samples, *early, name)
        b = _window_median(samples, *late, name)
        out[name] = {"after_warmup": a, "end": b, "growth": None if a is None else (b or 0) - a}
    out["peak_rss"] = max((s.total("rss") for s in samples), default=0)
    anon, files = out["anon"], out["open_files"]
    # Too short a run has no samples after the warm-up: nothing to judge, nothing failed.
    out["judged"] = anon["growth"] is not None and files["growth"] is not None
    out["memory_flat"] = anon["growth"] is None or anon["growth"] <= max(
        FLAT_MB * MB, FLAT_SHARE * anon["after_warmup"]
    )
    out["open_files_flat"] = files["growth"] is None or files["growth"] <= FD_SLACK
    return out


def _shm(samples: list[ServerSample], pool_bytes: int | None) -> dict[str, Any]:
    counts = sorted({s.shm_segments for s in samples})
    peak = max((s.shm_bytes for s in samples), default=0)
    within = pool_bytes is None or peak <= pool_bytes * 1.01 + MB
    return {"segment_counts_seen": counts, "peak_bytes": peak, "pool_bytes": pool_bytes,
            "within_pool": within}  # fmt: skip


def _pool_bytes(stats: dict[str, Any]) -> int | None:
    cache = stats.get("cache") or {}
    host = cache.get("host")
    if not host or not cache.get("page_bytes"):
        return 0 if cache else None
    return int(host["total"] * cache["page_bytes"])


@dataclass
class SoakReport:
    config: dict[str, Any]
    seconds: float
    requests: dict[str, Any]
    latency_s: dict[str, Any]
    memory: dict[str, Any]
    shm: dict[str, Any]
    restarts: dict[str, int]
    end_state: dict[str, Any]
    passed: bool
    problems: list[str]
    timeline: list[dict[str, Any]]


def summarize(
    cfg: SoakConfig, tally: Tally, samples: list[ServerSample], stats: list[dict[str, Any]],
    final: dict[str, Any], seconds: float,
) -> SoakReport:  # fmt: skip
    memory = _memory(samples, cfg, seconds)
    shm = _shm(samples, _pool_bytes(final))
    integrity = final.get("integrity") or {"ok": False, "error": "no answer"}
    problems = []
    if tally.errors:
        problems.append(f"{sum(tally.errors.values())} errors: {dict(tally.errors)}")
    if tally.mismatches:
        problems.append(f"{tally.mismatches} greedy answers differ from earlier ones")
    if not integrity.get("ok"):
        problems.append(f"integrity: {integrity.get('error')}")
    if not idle(final):
        problems.append("pages or requests still in use after the clients stopped")
    if not memory["memory_flat"]:
        problems.append(f"private memory grew by {memory['anon']['growth'] / MB:.0f} MB")
    if not memory["open_files_flat"]:
        problems.append(f"open files grew by {memory['open_files']['growth']}")
    if not shm["within_pool"] or len(shm["segment_counts_seen"]) > 1:
        problems.append(f"shared memory beyond the pool: {shm}")
    cache = final.get("cache") or {}
    return SoakReport(
        config=asdict(cfg) | {"api_key": "***" if cfg.api_key else None},
        seconds=seconds,
        requests={
            "started": tally.started,
            "completed": tally.completed,
            "deliberate_disconnects": tally.disconnects,
            "errors": sum(tally.errors.values()),
            "errors_by_kind": dict(tally.errors),
            "error_examples": tally.error_examples,
            "mismatches": tally.mismatches,
            "mismatch_examples": tally.mismatch_examples,
            "per_s": tally.completed / seconds if seconds else 0.0,
            "completion_tokens_per_s": tally.completion_tokens / seconds if seconds else 0.0,
        },
        latency_s={
            name: {f"p{int(q * 100)}": _pct(vals, q) for q in (0.5, 0.9, 0.99)}
            for name, vals in (("ttft", tally.ttft), ("e2e", tally.e2e))
        },
        memory=memory,
        shm=shm,
        restarts=_restarts(samples),
        end_state={
            "integrity": integrity,
            "queues": final.get("queues"),
            "device": cache.get("device"),
            "host": cache.get("host"),
            "counters": cache.get("counters"),
        },
        passed=not problems,
        problems=problems,
        timeline=_timeline(samples, stats),
    )


def _timeline(samples: list[ServerSample], stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pools = {round(s["t"], 3): s for s in stats}
    rows = []
    for s in samples:
        row: dict[str, Any] = {"t": round(s.t, 1), "shm_bytes": s.shm_bytes}
        for p in s.procs:
            row[p.role] = {"rss_mb": round(p.rss / MB, 1), "anon_mb": round(p.anon / MB, 1),
                           "shmem_mb": round(p.shmem / MB, 1), "open_files": p.open_files,
                           "threads": p.threads}  # fmt: skip
        pool = pools.get(round(s.t, 3))
        if pool:
            row["queues"] = pool["queues"]
            row["device_in_use"] = (pool.get("device") or {}).get("in_use")
        rows.append(row)
    return rows


def render(report: SoakReport) -> str:
    """A short human summary of a report."""
    rq, lat, mem = report.requests, report.latency_s, report.memory

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    lines = [
        f"soak: {report.config['clients']} clients, {report.seconds:.0f} s",
        f"  requests: {rq['started']} started, {rq['completed']} completed, "
        f"{rq['deliberate_disconnects']} deliberate disconnects, {rq['errors']} errors, "
        f"{rq['mismatches']} differing answers ({rq['per_s']:.2f} req/s)",
        f"  ttft p50 {ms(lat['ttft']['p50'])} p99 {ms(lat['ttft']['p99'])}; "
        f"e2e p50 {ms(lat['e2e']['p50'])} p99 {ms(lat['e2e']['p99'])}",
    ]
    for name in ("anon", "rss"):
        m = mem[name]
        if m["after_warmup"] is not None:
            lines.append(
                f"  {name} memory after warm-up {m['after_warmup'] / MB:.0f} MB, end "
                f"{(m['end'] or 0) / MB:.0f} MB (growth {m['growth'] / MB:+.1f} MB)"
            )
    files = mem["open_files"]
    lines.append(f"  open files after warm-up {files['after_warmup']}, end {files['end']}")
    if not mem["judged"]:
        lines.append("  (too few samples after the warm-up to judge memory and open files)")
    lines.append(f"  /dev/shm: {report.shm}")
    lines.append(f"  restarts: {report.restarts}; integrity: {report.end_state['integrity']}")
    lines.append("  PASS" if report.passed else "  FAIL: " + "; ".join(report.problems))
    return "\n".join(lines)
