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
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from asynchicache.bench.procwatch import ServerSample, ServerWatch

MB = 1 << 20
# Flat means: after warm-up, private memory grows by less than this (absolute or relative).
FLAT_MB = 64
FLAT_SHARE = 0.05
FD_SLACK = 16


@dataclass(frozen=True)
class SoakConfig:
    """One soak run."""

    url: str
    clients: int = 16
    duration_s: float = 60.0
    max_tokens: int = 12
    disconnect_rate: float = 0.1  # share of requests abandoned mid-stream on purpose
    prompts: int = 48
    prefix_lines: int = 40  # lines of each shared system prefix (about 21 tokens each)
    prefixes: int = 4  # distinct system prefixes (more than the tiers hold: L2/L3 churn)
    sample_s: float = 5.0
    warmup_s: float | None = None  # default: a fifth of the run
    api_key: str | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.clients <= 0:
            raise ValueError(f"--clients must be positive, got {self.clients}")
        if self.duration_s <= 0:
            raise ValueError(f"--duration must be positive, got {self.duration_s}")
        if not 0 <= self.disconnect_rate < 1:
            raise ValueError(f"--disconnect-rate must be in [0, 1), got {self.disconnect_rate}")
        if min(self.prompts, self.max_tokens, self.sample_s, self.prefix_lines, self.prefixes) <= 0:
            raise ValueError(
                "--prompts, --max-tokens, --sample-interval, --prefix-lines and --prefixes "
                "must be positive"
            )
        if urlparse(self.url).scheme not in ("http", "https"):
            raise ValueError(f"--url must be like http://127.0.0.1:8000, got {self.url}")

    @property
    def warmup(self) -> float:
        return self.duration_s / 5 if self.warmup_s is None else self.warmup_s

    @property
    def port(self) -> int:
        parsed = urlparse(self.url)
        return parsed.port or (443 if parsed.scheme == "https" else 80)


# ---------------------------------------------------------------------------- workload

_TOPICS = ("lighthouse keepers", "glacier surveys", "orchard ledgers", "ferry timetables")


@dataclass(frozen=True)
class SoakPrompt:
    """One request body's variable part: chat messages or a completion prompt."""

    key: str
    chat: bool
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""

    def body(self, max_tokens: int) -> dict[str, Any]:
        common = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        if self.chat:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages], **common}
        return {"prompt": self.prompt, **common}


def _system(topic: str, rng: random.Random, n_lines: int) -> str:
    lines = [
        f"Record {i}: the {topic} report {rng.randint(100, 999)} units on day {i}."
        for i in range(n_lines)
    ]
    return f"You answer questions about {topic}.\n" + "\n".join(lines)


def make_prompts(
    n: int, seed: int, prefix_lines: int = 40, prefixes: int = len(_TOPICS)
) -> list[SoakPrompt]:
    """`n` prompts over `prefixes` long shared prefixes: chat and completions, half each."""
    rng = random.Random(seed)
    topics = [f"{_TOPICS[i % len(_TOPICS)]} (series {i // len(_TOPICS)})" for i in range(prefixes)]
    systems = [_system(t, rng, prefix_lines) for t in topics]
    out = []
    for k in range(n):
        system = systems[k % len(systems)]
        question = f"Question {k}: what happened on day {rng.randint(0, prefix_lines - 1)}?"
        if k % 2 == 0:
            out.append(SoakPrompt(f"c{k}", True, (("system", system), ("user", question))))
        else:
            out.append(SoakPrompt(f"p{k}", False, prompt=f"{system}\n{question}\nAnswer:"))
    return out


# ---------------------------------------------------------------------------- clients


@dataclass
class Tally:
    """What the clients saw (one per run; only the event loop thread touches it)."""

    started: int = 0
    completed: int = 0
    disconnects: int = 0
    completion_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    mismatches: int = 0
    mismatch_examples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(f"{kind}: {detail[:300]}")

    def answer(self, key: str, text: str) -> None:
        first = self.answers.setdefault(key, text)
        if first != text:
            self.mismatches += 1
            if len(self.mismatch_examples) < 10:
                self.mismatch_examples.append(f"{key}: {text!r} != {first!r}")


@dataclass
class _Stream:
    text: str = ""
    chunks: int = 0
    ttft: float | None = None
    done: bool = False
    tokens: int = 0


def _consume(line: str, s: _Stream, t0: float) -> str | None:
    """Fold one SSE line into `s`; an error text when the server sent one."""
    if not line.startswith("data: "):
        return None
    if line == "data: [DONE]":
        s.done = True
        return None
    chunk = json.loads(line[6:])
    if "error" in chunk:
        return str(chunk["error"])
    for choice in chunk.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if piece and s.ttft is None:
            s.ttft = time.perf_counter() - t0
        s.text += piece
    if chunk.get("usage"):
        s.tokens = chunk["usage"].get("completion_tokens", 0)
    s.chunks += 1
    return None


async def _request(
    http: httpx.AsyncClient, p: SoakPrompt, cfg: SoakConfig, cut_after: int | None, tally: Tally
) -> None:
    path = "/v1/chat/completions" if p.chat else "/v1/completions"
    t0 = time.perf_counter()
    s = _Stream()
    tally.started += 1
    try:
        async with http.stream("POST", path, json=p.body(cfg.max_tokens)) as r:
            if r.status_code != 200:
                tally.error(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
                return
            async for line in r.aiter_lines():
                problem = _consume(line, s, t0)
                if problem is not None:
                    tally.error("stream_error", problem)
                    return
                if s.done:
                    break
                if cut_after is not None and s.chunks >= cut_after:
                    tally.disconnects += 1  # leaving the block closes the connection
                    return
    except httpx.TimeoutException as exc:
        tally.error("timeout", repr(exc))
        return
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        tally.error(type(exc).__name__, repr(exc))
        return
    if not s.done:
        tally.error("truncated", f"{p.key}: stream ended without [DONE]")
        return
    tally.completed += 1
    tally.completion_tokens += s.tokens
    tally.e2e.append(time.perf_counter() - t0)
    if s.ttft is not None:
        tally.ttft.append(s.ttft)
    tally.answer(p.key, s.text)


async def _client(
    index: int, http: httpx.AsyncClient, cfg: SoakConfig, prompts: list[SoakPrompt],
    tally: Tally, deadline: float,
) -> None:  # fmt: skip
    rng = random.Random(cfg.seed * 1000 + index)
    while time.monotonic() < deadline:
        cut = rng.randint(1, 3) if rng.random() < cfg.disconnect_rate else None
        await _request(http, rng.choice(prompts), cfg, cut, tally)


# ---------------------------------------------------------------------------- monitor


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
        r.raise_for_status()
        stats = r.json()
        if _idle(stats):
            break
        await asyncio.sleep(0.5)
    return stats


def _idle(stats: dict[str, Any]) -> bool:
    cache = stats.get("cache") or {}
    queues = stats.get("queues") or {}
    in_use = [(cache.get(t) or {}).get("in_use", 0) for t in ("device", "host")]
    return not any(queues.values()) and not any(in_use) and not cache.get("pending_transfers")


# ---------------------------------------------------------------------------- report


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
    if not _idle(final):
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


# ---------------------------------------------------------------------------- run


async def run_soak(cfg: SoakConfig) -> SoakReport:
    """Drive the clients for `cfg.duration_s`, then drain and check the server."""
    watch = ServerWatch.for_port(cfg.port)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.clients + 4, max_keepalive_connections=cfg.clients)
    tally, samples, stats = Tally(), [], []
    prompts = make_prompts(cfg.prompts, cfg.seed, cfg.prefix_lines, cfg.prefixes)
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=cfg.request_timeout_s, limits=limits
    ) as http:
        t0 = time.monotonic()
        stop = asyncio.Event()
        monitor = asyncio.create_task(_monitor(watch, http, cfg, t0, samples, stats, stop))
        deadline = t0 + cfg.duration_s
        await asyncio.gather(
            *(_client(i, http, cfg, prompts, tally, deadline) for i in range(cfg.clients))
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
    p.add_argument("--out", type=Path, help="write the JSON report (with the timeline) here")
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
    print(render(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(report), indent=2))
        print(f"report: {args.out}", file=sys.stderr)
    return 0 if report.passed else 1
