"""What the vLLM connector says it served, read from a vLLM server's /metrics text.

`bench pressure` (vLLM arms) and `bench vllm` report, beside vLLM's own prefix
cache counters, the connector's hits by size and tier
(`vllm:asynchicache_hits_total{tier,size}`), its hit tokens per tier and its
events (`skipped_unprofitable`, `lookups_not_waited`, ...): a vLLM without the
connector has none of them, and they are left out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_LABEL = re.compile(r'(\w+)="([^"]*)"')
_PREFIX = "vllm:asynchicache_"


def _labels(key: str) -> dict[str, str]:
    return dict(_LABEL.findall(key.partition("{")[2]))


def connector_counters(metrics: Mapping[str, float]) -> dict[str, Any]:
    """Our counters in a /metrics scrape (`name{labels}` -> value), summed over engines."""
    hits: dict[str, dict[str, float]] = {}
    tokens: dict[str, float] = {}
    events: dict[str, float] = {}
    for key, value in metrics.items():
        if not key.startswith(_PREFIX) or not value:
            continue
        name, labels = key.partition("{")[0].removeprefix(_PREFIX), _labels(key)
        if name == "hits_total":
            by_size = hits.setdefault(labels.get("tier", "?"), {})
            size = labels.get("size", "?")
            by_size[size] = by_size.get(size, 0) + value
        elif name == "hit_tokens_total":
            tier = labels.get("tier", "?")
            tokens[tier] = tokens.get(tier, 0) + value
        elif name == "events_total":
            event = labels.get("event", "?")
            events[event] = events.get(event, 0) + value
    if not (hits or tokens or events):
        return {}
    return {"connector_hits": hits, "connector_hit_tokens": tokens, "connector_events": events}
