"""Prometheus metrics: request latencies measured here, cache counters from the engine.

Two sources, one registry per app (no global registry, so several apps can
live in one process, e.g. in tests):

* `RequestMetrics`: histograms of time to first token, end-to-end latency and
  inter-token latency, and token counters, observed in the HTTP process (each
  also under vLLM's name: server/compat_metrics.py);
* the engine's `AdminReply("stats")` payload, fetched at each scrape and exported
  by `EngineStatsCollector` (server/engine_metrics.py: ours, with per-tier hit
  rates and load/store latency histograms) and `PeerEngineCollector` (vLLM's and
  SGLang's names).

Labels carry tiers, endpoints, reasons and the served model's name: never a
salt, a prompt or a token id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from asynchicache.common.tiers import TIERS
from asynchicache.engine.protocol import CachedTokens
from asynchicache.server.compat_metrics import PeerEngineCollector, PeerRequestMetrics
from asynchicache.server.engine_metrics import PREFIX, EngineStatsCollector

# Latency buckets from 1 ms (a cached prefix on a GPU) to minutes (a long cold
# prompt on a small CPU).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300
)  # fmt: skip
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _Both:
    """One observation into our histogram and vLLM's (labelled by the served model)."""

    def __init__(self, ours: Histogram, theirs: Histogram, peer: PeerRequestMetrics) -> None:
        self.ours, self.theirs, self.peer = ours, theirs, peer

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        self.theirs.labels(*self.peer.labels).observe(value)


class RequestMetrics:
    """What the HTTP process measures about each request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.peer = peer = PeerRequestMetrics(registry)

        def seconds(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}_seconds", doc, registry=registry, buckets=buckets)

        ttft = seconds(
            "time_to_first_token",
            "Time from request arrival to the first generated token.",
            _LATENCY_BUCKETS,
        )
        e2e = seconds(
            "e2e_request_latency", "Time from request arrival to its last token.", _LATENCY_BUCKETS
        )
        itl = seconds(
            "inter_token_latency",
            "Time between consecutive generated tokens of one request.",
            _ITL_BUCKETS,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished generation requests by endpoint and finish reason.",
            ["endpoint", "finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens.", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens served from a cache tier instead of recomputed.",
            ["tier"],
            registry=registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight", "Generation requests being served.", registry=registry
        )
        for tier in TIERS:  # export zeros from the start, so rate() has a baseline
            self.cached_prompt_tokens.labels(tier)
        self.ttft = _Both(ttft, peer.ttft, peer)
        self.itl = _Both(itl, peer.itl, peer)
        self.e2e = _Both(e2e, peer.e2e, peer)

    def finished(
        self, endpoint: str, reason: str, prompt: int, completion: int, cached: CachedTokens
    ) -> None:
        self.requests.labels(endpoint, reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        for tier in TIERS:
            self.cached_prompt_tokens.labels(tier).inc(getattr(cached, tier))
        self.peer.finished(reason, prompt, completion, cached)


class ServerMetrics:
    """The registry of one app: request metrics plus the engine stats collectors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        self.engine = EngineStatsCollector()
        self.peer_engine = PeerEngineCollector()
        self.registry.register(self.engine)
        self.registry.register(self.peer_engine)

    def bind_model(self, name: str, page_size: int) -> None:
        """The served model's name (vLLM's and SGLang's `model_name` label) and page size."""
        self.requests.peer.bind(name)
        self.peer_engine.model_name = name
        self.peer_engine.page_size = page_size

    def render(self, engine_payload: Mapping[str, Any] | None) -> bytes:
        self.engine.update(engine_payload)
        self.peer_engine.payload = engine_payload or {}
        return generate_latest(self.registry)
