"""An asynchronous streaming OpenAI client that plays a workload and times every request.

    asynchicache bench serve --url http://127.0.0.1:8000 --workload multiturn --out DIR

Each request is a streamed `/v1/chat/completions` call (temperature 0,
`ignore_eos`, fixed `max_tokens`, `stream_options.include_usage`) sent at its
Poisson arrival time, or later when its chat session's previous answer is
still running. Time to first token, the gaps between tokens, the end-to-end
time and the server's per-tier cached-token counts are recorded per request
(`results.jsonl`) and summarised (`summary.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from asynchicache.bench.reports.output import add_output_arguments, print_report, write_report
from asynchicache.bench.reports.run_results import RequestResult, write_results
from asynchicache.bench.reports.summary import summarize
from asynchicache.bench.workloads.workloads import RequestSpec, Workload, make_workload
from asynchicache.common.tiers import TIERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str | None = None
    model: str | None = None  # the `model` field; None lets the server use its own
    cache_salt: str | None = None
    max_concurrency: int | None = None  # None: every arrived request is sent at once
    timeout_s: float = 1800.0
    progress: bool = True
    label: str = ""  # progress bar description

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be positive, got {self.max_concurrency}")


@dataclass(frozen=True)
class Run:
    """The results of one workload run, in dispatch order, and its wall time."""

    results: tuple[RequestResult, ...]
    duration_s: float


@dataclass
class Streamed:
    """What one streamed response told us so far."""

    first_s: float | None = None
    last_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None

    def on_text(self, now: float, piece: str) -> None:
        if self.last_s is not None:
            self.gaps.append(now - self.last_s)
        if self.first_s is None:
            self.first_s = now
        self.last_s = now
        self.parts.append(piece)


def exact_chat_body(messages: Any, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A greedy streamed chat request that decodes exactly `max_tokens` (ignore_eos), so
    every server under comparison does the same work; usage comes in its last chunk.
    `fields`: further body fields (model, cache_salt)."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **fields,
    }


def _request_body(workload: Workload, messages: list[dict[str, str]], cfg: ClientConfig) -> dict:
    body = exact_chat_body(messages, workload.max_tokens)
    if cfg.model:
        body["model"] = cfg.model
    if cfg.cache_salt:
        body["cache_salt"] = cfg.cache_salt
    return body


def _on_event(stream: Streamed, payload: str, now: float) -> None:
    chunk = json.loads(payload)
    if "error" in chunk:
        raise RuntimeError(f"server error in stream: {chunk['error']}")
    for choice in chunk.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            stream.on_text(now, piece)
    if chunk.get("usage"):
        stream.usage = chunk["usage"]


async def stream_chat(client: httpx.AsyncClient, body: dict, t_sent: float) -> Streamed:
    stream = Streamed()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            _on_event(stream, payload, time.perf_counter() - t_sent)
    if stream.usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return stream


def _result(
    spec: RequestSpec, index: int, sched: float, sent: float, s: Streamed, e2e: float
) -> RequestResult:
    usage = s.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    by_tier = details.get("cached_tokens_by_tier") or {}
    return RequestResult(
        index=index,
        session=spec.session,
        turn=spec.turn,
        scheduled_s=sched,
        sent_s=sent,
        ttft_s=s.first_s if s.first_s is not None else e2e,  # no text at all: the whole call
        e2e_s=e2e,
        itl_s=tuple(s.gaps),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0)),
        cached_by_tier={t: int(by_tier.get(t, 0)) for t in TIERS},
        answer="".join(s.parts),
    )


class _Player:
    """Sends a workload's requests at their times, chat turns after their predecessors."""

    def __init__(
        self, workload: Workload, cfg: ClientConfig, client: httpx.AsyncClient, bar: tqdm
    ) -> None:
        self.workload = workload
        self.cfg = cfg
        self.client = client
        self.bar = bar
        n = len(workload.sessions)
        self.answers: list[dict[int, str]] = [{} for _ in range(n)]
        self.done: dict[tuple[int, int], asyncio.Event] = {
            (r.session, r.turn): asyncio.Event() for r in workload.requests
        }
        limit = cfg.max_concurrency
        self.slots = asyncio.Semaphore(limit) if limit else None
        self.t0 = 0.0

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    async def play(self) -> Run:
        self.t0 = time.perf_counter()
        tasks = [self._one(i, spec) for i, spec in enumerate(self.workload.requests)]
        results = await asyncio.gather(*tasks)
        return Run(tuple(results), self._now())

    async def _one(self, index: int, spec: RequestSpec) -> RequestResult:
        try:
            await asyncio.sleep(max(0.0, spec.arrival_s - self._now()))
            if self.workload.waits_for_previous(spec):
                await self.done[(spec.session, spec.turn - 1)].wait()
            return await self._send(index, spec)
        finally:
            self.done[(spec.session, spec.turn)].set()
            self.bar.update(1)

    async def _send(self, index: int, spec: RequestSpec) -> RequestResult:
        sched = spec.arrival_s
        answers = self.answers[spec.session]
        earlier = [answers.get(t) for t in range(spec.turn)]
        if self.workload.waits_for_previous(spec) and None in earlier:
            return RequestResult(
                index,
                spec.session,
                spec.turn,
                sched,
                self._now(),
                error="an earlier turn of this chat failed",
            )
        messages = self.workload.messages(spec, [a or "" for a in earlier])
        body = _request_body(self.workload, messages, self.cfg)
        if self.slots is not None:
            await self.slots.acquire()
        sent = self._now()
        t_sent = time.perf_counter()
        try:
            stream = await stream_chat(self.client, body, t_sent)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            log.warning("request %d failed: %s", index, exc)
            return RequestResult(
                index, spec.session, spec.turn, sched, sent, error=f"{type(exc).__name__}: {exc}"
            )
        finally:
            if self.slots is not None:
                self.slots.release()
        result = _result(spec, index, sched, sent, stream, time.perf_counter() - t_sent)
        answers[spec.turn] = result.answer
        return result


async def run_workload_async(workload: Workload, cfg: ClientConfig) -> Run:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        with tqdm(
            total=len(workload.requests),
            desc=cfg.label or workload.name,
            unit="req",
            disable=not cfg.progress,
            leave=False,
        ) as bar:
            return await _Player(workload, cfg, client, bar).play()


def run_workload(workload: Workload, cfg: ClientConfig) -> Run:
    """Play `workload` against the server at `cfg.url`; blocks until every request ended."""
    return asyncio.run(run_workload_async(workload, cfg))


# ---------------------------------------------------------------- bench serve
def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `bench serve` and `bench sweep`."""
    p.add_argument(
        "--workload",
        required=True,
        help="multiturn, longdoc or sysprompt (bench sweep: also restart)",
    )
    p.add_argument("--seed", type=int, default=0, help="text and arrival times (default 0)")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every prompt length (system prompts, documents, questions)",
    )
    p.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a workload parameter, e.g. --set users=4 --set rate=0.5",
    )
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight (default none)")
    p.add_argument(
        "--model",
        help="model files: tokenizer of the ideal hit rate (bench sweep: "
        "also the servers' model; default: the embedded model)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="tokens per KV page of the ideal replay (bench sweep: also the servers')",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynchicache bench serve", description="Play a workload against a running server."
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add_output_arguments(p, "summary.json (and results.jsonl)", out_required=True)
    p.add_argument("--api-key", help="bearer token, if the server wants one")
    p.add_argument("--served-model-name", help="the `model` field to send (default: none)")
    p.add_argument("--cache-salt", help="cache namespace of every request (default: none)")
    p.add_argument("--no-ideal", action="store_true", help="skip the ideal hit rate")
    add_workload_arguments(p)
    return p


def main(argv: Sequence[str]) -> int:
    """`asynchicache bench serve`: one run, results.jsonl and summary.json under --out."""
    from asynchicache.bench.workloads.prompts import ideal_of_run

    args = _serve_parser().parse_args(list(argv))
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    if args.workload == "restart":
        raise SystemExit("the restart workload restarts the server: use `bench sweep`")
    workload = make_workload(args.workload, args.seed, args.scale, args.assignments)
    cfg = ClientConfig(
        args.url.rstrip("/"),
        args.api_key,
        args.served_model_name,
        args.cache_salt,
        args.max_concurrency,
        progress=not args.no_progress,
    )
    run = run_workload(workload, cfg)
    write_results(args.out / "results.jsonl", run.results)
    summary: dict[str, Any] = {
        "workload": workload.name,
        "params": dict(workload.params),
        "seed": args.seed,
        "url": cfg.url,
        **summarize(run.results, run.duration_s).to_dict(),
    }
    if not args.no_ideal:
        summary["ideal"] = ideal_of_run(workload, run.results, args.model, args.page_size)
    write_report(args.out, "summary.json", summary)
    headline = {k: summary[k] for k in ("requests", "errors", "hit_rate", "ttft")}
    print_report(args, summary, json.dumps(headline, indent=2))
    return 0 if summary["errors"] == 0 else 1
