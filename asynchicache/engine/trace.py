"""Where a request's time to first token goes, inside the engine: a trace per request.

For each request (a group's leader), from the moment the engine took it:

    arrived      when the engine received it (engine/inbox.py: during a step too)
    queue_s      waiting until admitted (matched: a load started, or it runs)
    load_s       in LOADING: storage -> L2 -> L1 until the scheduler collected it
    load_ticket_s  of that, the loads' own time, submit to done (`LoadTicket.elapsed_s`:
                 an L2 -> L1 copy alone when `load_storage_pages` is 0), with
                 `load_host_pages` and `load_storage_pages` (an arrival prefetch's
                 storage -> L2 read is not in it: it overlaps `queue_s`)
    wait_s       admitted and not loading, but in no forward: waiting for a step
                 (its prefill chunk did not fit this step's token budget, or
                 the step before it was still running)
    steps, step_s  the forwards that carried its prompt, and their time
    max_step_s   the longest of them, with its tokens (`max_step_tokens`): a step
                 stretched by other requests' prefill shows here
    overhead_s   engine time outside the forward in those steps (scheduling,
                 cache polls, matches, inserts, write-through submits)

and `first_token` (the end of the forward that sampled its first token), all
on `time.monotonic()` (CLOCK_MONOTONIC, which a client's `perf_counter` shares
on Linux, so a benchmark can line the engine's trace up with its own times).

The engine keeps the traces of the last `KEEP` requests; `summary()` (in the
engine's stats, `/cache/stats` -> `request_traces`) gives the percentiles of
each phase, the slowest requests' whole traces, and `forwards`: every forward
since start (`ForwardTotals`: their count, seconds and tokens, and the share of
the time from the first forward's start to the last one's end spent in them),
which says whether a slow run was an engine at work or one waiting. Hooks are cheap: a few
clock reads and a pass over the requests in flight per step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from asynchicache.engine.request import Phase, Request

KEEP = 4096  # traces of finished requests kept for `summary`
SLOWEST = 16  # whole traces the summary shows


@dataclass
class RequestTrace:
    """One request's way to its first token (module docstring)."""

    rid: str
    prompt_tokens: int
    arrived: float
    admitted: float | None = None
    loading_since: float | None = None
    load_s: float = 0.0
    first_step: float | None = None
    first_token: float | None = None
    steps: int = 0
    step_s: float = 0.0
    overhead_s: float = 0.0
    max_step_s: float = 0.0
    max_step_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens its forwards computed
    cached: dict[str, int] = field(default_factory=dict)
    load_ticket_s: float = 0.0
    load_host_pages: int = 0
    load_storage_pages: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def queue_s(self) -> float:
        end = self.admitted if self.admitted is not None else self.first_token
        return 0.0 if end is None else end - self.arrived

    @property
    def wait_s(self) -> float:
        """Admitted, not loading, not in a forward, before the first token."""
        if self.first_token is None or self.admitted is None:
            return 0.0
        busy = self.load_s + self.step_s + self.overhead_s
        return max(0.0, self.first_token - self.admitted - busy)

    def report(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "loading_since"}
        out.update(ttft_s=self.ttft_s, queue_s=self.queue_s, wait_s=self.wait_s)
        return out


@dataclass
class ForwardTotals:
    """Every forward since the engine started: how many, how long, how many tokens."""

    forwards: int = 0
    forward_s: float = 0.0
    tokens: int = 0  # new tokens: prompt chunks and decodes
    first_began: float | None = None
    last_ended: float = 0.0

    def add(self, began: float, seconds: float, tokens: int) -> None:
        self.forwards += 1
        self.forward_s += seconds
        self.tokens += tokens
        self.first_began = began if self.first_began is None else self.first_began
        self.last_ended = max(self.last_ended, began + seconds)

    def report(self) -> dict[str, float]:
        span = 0.0 if self.first_began is None else self.last_ended - self.first_began
        return {
            "forwards": self.forwards,
            "forward_s": round(self.forward_s, 3),
            "tokens": self.tokens,
            "span_s": round(span, 3),
            "busy_fraction": round(self.forward_s / span, 4) if span > 0 else 0.0,
            "tokens_per_forward_s": round(self.tokens / self.forward_s, 1)
            if self.forward_s > 0
            else 0.0,
        }


class Tracer:
    """Follows the requests in flight through the engine's steps (module docstring)."""

    def __init__(self, keep: int = KEEP, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[int, tuple[Request, RequestTrace]] = {}  # id(request) -> trace
        self._done: deque[RequestTrace] = deque(maxlen=keep)
        self._step_began = 0.0
        self._forward_s = 0.0
        # Carried by this step's forward before their first token.
        self._in_step: list[tuple[Request, RequestTrace]] = []
        self._credit: dict[int, float] = {}  # step overhead already counted as load time
        self.totals = ForwardTotals()

    def arrived(self, req: Request) -> None:
        self._open[id(req)] = (req, RequestTrace(req.rid, len(req.prompt), req.arrival))

    def step_began(self) -> None:
        self._step_began = self._clock()
        self._forward_s = 0.0
        self._in_step = []
        self._credit = {}

    def scheduled(self, landed: Iterable[tuple[Request, float]] = ()) -> None:
        """After the scheduler's step: who was admitted, who started or ended a load.

        Stamped with the step's beginning: the scheduling itself is the step's overhead,
        except the seconds the scheduler waited for a load to land in this step (`landed`,
        engine/scheduling/prefill_policy.py), which are that request's load time."""
        for req, waited in landed:
            entry = self._open.get(id(req))
            if entry is not None:
                entry[1].load_s += waited
                self._credit[id(req)] = waited
        now = self._step_began
        for req, trace in self._open.values():
            if trace.first_token is not None:
                continue
            if trace.admitted is None and req.phase is not Phase.WAITING:
                trace.admitted = now
            if req.phase is Phase.LOADING and trace.loading_since is None:
                trace.loading_since = now
            elif req.phase is not Phase.LOADING and trace.loading_since is not None:
                trace.load_s += now - trace.loading_since
                trace.loading_since = None

    def forward(self, reqs: Iterable[tuple[Request, int]], began: float, seconds: float) -> None:
        """A forward of `(request, new tokens)` pairs, begun at `began`, took `seconds`."""
        self._forward_s += seconds
        pairs = list(reqs)
        tokens = sum(n for _, n in pairs)
        self.totals.add(began, seconds, tokens)
        for req, n in pairs:
            entry = self._open.get(id(req))
            if entry is None or entry[1].first_token is not None:
                continue
            trace = entry[1]
            self._in_step.append(entry)
            trace.first_step = began if trace.first_step is None else trace.first_step
            trace.steps += 1
            trace.step_s += seconds
            trace.computed_tokens += min(n, max(0, len(req.prompt) - req.num_computed))
            if seconds > trace.max_step_s:
                trace.max_step_s, trace.max_step_tokens = seconds, tokens

    def answered(self, req: Request) -> None:
        """`req` got its first token before any forward (engine/sampling/prompt_logits.py)."""
        entry = self._open.get(id(req))
        if entry is not None and entry[1].first_token is None:
            now = self._clock()
            entry[1].admitted = entry[1].admitted or now
            entry[1].first_token = now

    def step_ended(self) -> None:
        """The step is over: its time outside the forward is its requests' overhead, and
        those that have a token now (or ended: a prompt-only request) got it now."""
        now = self._clock()
        overhead = max(0.0, now - self._step_began - self._forward_s)
        for req, trace in self._in_step:
            trace.overhead_s += max(0.0, overhead - self._credit.get(id(req), 0.0))
            if req.output or req.phase is Phase.FINISHED:
                trace.first_token = now
        self._in_step = []

    def finished(self, req: Request) -> None:
        entry = self._open.pop(id(req), None)
        if entry is None:
            return
        trace = entry[1]
        trace.cached = {k: v for k, v in asdict(req.cached).items() if v}
        trace.load_ticket_s = req.load_ticket_s
        trace.load_host_pages, trace.load_storage_pages = (
            req.loaded_host_pages,
            req.loaded_storage_pages,
        )
        if trace.loading_since is not None:  # ended while loading (aborted)
            trace.load_s += self._clock() - trace.loading_since
            trace.loading_since = None
        self._done.append(trace)

    def traces(self) -> list[RequestTrace]:
        return list(self._done)

    def reports(self) -> list[dict[str, Any]]:
        """Every kept trace whole, oldest first (`/cache/stats?traces=true`: bench pressure
        lines each client request up with its trace)."""
        return [t.report() for t in self._done]

    def summary(self, slowest: int = SLOWEST) -> dict[str, Any]:
        """Percentiles of every phase over the kept traces, and the slowest ones whole."""
        done = [t for t in self._done if t.ttft_s is not None]
        if not done:
            return {"requests": 0, "forwards": self.totals.report()}
        phases = ("ttft_s", "queue_s", "load_s", "wait_s", "step_s", "overhead_s", "max_step_s")
        out: dict[str, Any] = {"requests": len(done), "forwards": self.totals.report()}
        for name in phases:
            values = sorted(getattr(t, name) for t in done)
            out[name] = _percentiles(values)
        ranked = sorted(done, key=lambda t: t.ttft_s or 0.0, reverse=True)
        out["slowest"] = [t.report() for t in ranked[:slowest]]
        return out


def _percentiles(values: list[float]) -> dict[str, float]:
    def at(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "mean": round(statistics.fmean(values), 5),
        "p50": round(at(0.5), 5),
        "p90": round(at(0.9), 5),
        "p99": round(at(0.99), 5),
        "max": round(values[-1], 5),
    }
