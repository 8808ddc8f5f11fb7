"""`asynchicache fleet credits`: what a cached token is worth, per tier, on this model and
host, as vllm-router's `--kv-penalty-*` flags and llm-d's per-medium weights.

A router that credits a prefix an instance holds in a lower tier should price it by
time: loading it costs something, recomputing it costs more. Against a running server
(`--url`, ours, with the tiers to measure configured), for each tier and each of
`--repeats` fresh prompts of about `--prompt-tokens` tokens:

    cold   the prompt computed (nothing cached)
    tier   the same prompt again, after `/cache/clear` emptied every tier above it (and
           L4 too, for the disk), so it is loaded from that tier alone
    hot    once more: from L1

each timed as a completion of one token. Per token, compute = (cold - hot) / n (the
median over every cold prompt) and load = (tier - hot) / n (the median over the tier's),
n the tokens the usage says that tier served; the credit is 1 - load / compute, clamped
to [0, 1]. vllm-router then
credits a hit at its time's worth: `--kv-penalty-host` (L2), `--kv-penalty-disk` (L3),
`--kv-penalty-external` (L4, announced as the fleet's pool). It clears the server's
tiers: run it against an instance out of service (or before the fleet takes traffic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx

TIERS_BELOW = ("host", "disk", "remote")  # what a router credits below L1
ABOVE = {
    "host": ("device",),
    "disk": ("device", "host", "remote"),  # L4 too: the disk alone serves it
    "remote": ("device", "host", "disk"),
}
SETTLE_S = 3.0  # write-through to L3/L4 finishes after the reply


@dataclass(frozen=True)
class Credits:
    """vllm-router's per-tier credit for a cached token (1.0: as good as L1)."""

    host: float = 0.8  # its defaults
    disk: float = 0.3
    external: float = 0.6

    def flags(self) -> list[str]:
        return ["--kv-penalty-host", f"{self.host:.3f}", "--kv-penalty-disk", f"{self.disk:.3f}",
                "--kv-penalty-external", f"{self.external:.3f}"]  # fmt: skip


@dataclass(frozen=True)
class TierCost:
    tier: str
    tokens: int  # prompt tokens it served (median)
    load_s_per_token: float
    compute_s_per_token: float

    @property
    def credit(self) -> float:
        if self.compute_s_per_token <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.load_s_per_token / self.compute_s_per_token))


@dataclass(frozen=True)
class Sample:
    cold_s: float
    tier_s: float
    hot_s: float
    tokens: int


class Probe:
    """Timed completions against one server."""

    def __init__(self, url: str, model: str | None, api_key: str | None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=600)
        self.model = model or self.http.get("/v1/models").json()["data"][0]["id"]

    def complete(self, text: str) -> tuple[float, dict[str, int]]:
        body = {"model": self.model, "prompt": text, "max_tokens": 1, "temperature": 0}
        started = time.perf_counter()
        r = self.http.post("/v1/completions", json=body)
        took = time.perf_counter() - started
        r.raise_for_status()
        return took, r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]

    def clear(self, tiers: Sequence[str]) -> None:
        self.http.post("/cache/clear", json={"scope": list(tiers)}).raise_for_status()

    def sample(self, tier: str, words: int) -> Sample | None:
        """One fresh prompt through cold, `tier`-only and hot; None if `tier` served none
        of it (the tier is off, or did not take the pages)."""
        text = " ".join(f"c{uuid.uuid4().hex[:6]}" for _ in range(words))
        cold, _ = self.complete(text)
        time.sleep(SETTLE_S)
        self.clear(ABOVE[tier])
        took, usage = self.complete(text)
        hot, _ = self.complete(text)
        if usage.get(tier, 0) <= 0:
            return None
        return Sample(cold, took, hot, usage[tier])


def measure(probe: Probe, tiers: Sequence[str], words: int, repeats: int) -> list[TierCost]:
    """Per tier, the median load time per token; against one compute time per token, the
    median over every cold prompt (the same computation whatever the tier measured next)."""
    probe.complete("warm up " * 8)
    by_tier = {t: [s for s in (probe.sample(t, words) for _ in range(repeats)) if s]
               for t in tiers}  # fmt: skip
    every = [s for samples in by_tier.values() for s in samples]
    if not every:
        return []
    compute = statistics.median(max(0.0, s.cold_s - s.hot_s) / s.tokens for s in every)
    out = []
    for tier, samples in by_tier.items():
        if samples:
            n = statistics.median(s.tokens for s in samples)
            load = statistics.median(max(0.0, s.tier_s - s.hot_s) / s.tokens for s in samples)
            out.append(TierCost(tier, int(n), load, compute))
    return out


def credits_of(costs: Sequence[TierCost]) -> Credits:
    """vllm-router's credits; a tier not measured keeps its default."""
    by_tier = {c.tier: c.credit for c in costs}
    default = Credits()
    return Credits(
        host=by_tier.get("host", default.host),
        disk=by_tier.get("disk", default.disk),
        external=by_tier.get("remote", default.external),
    )


def llm_d_backends(credits: Credits) -> list[dict[str, str | float]]:
    """llm-d's precise prefix-cache scorer's weight per medium, as its
    `indexerConfig.kvCacheBackendConfigs` takes them: it names a block's tier by the
    event's medium in lower case (ours: GPU, CPU, DISK, EXTERNAL), and a list given
    replaces its defaults (gpu 1.0, cpu 0.8), so every medium is listed."""
    weights = {"gpu": 1.0, "cpu": credits.host, "disk": credits.disk,
               "external": credits.external}  # fmt: skip
    return [{"name": name, "weight": round(w, 3)} for name, w in weights.items()]


def llm_d_yaml(credits: Credits) -> str:
    """The scorer's parameters to paste under its plugin (`precise-prefix-cache-scorer`)."""
    lines = ["indexerConfig:", "  kvCacheBackendConfigs:"]
    for b in llm_d_backends(credits):
        lines.append(f"    - name: {b['name']}")
        lines.append(f"      weight: {b['weight']}")
    return "\n".join(lines)


def report(costs: Sequence[TierCost], credits: Credits) -> str:
    lines = ["tier    tokens  load ms/tok  compute ms/tok  credit"]
    for c in costs:
        lines.append(f"{c.tier:<7} {c.tokens:>6}  {c.load_s_per_token * 1e3:>11.4f}  "
                     f"{c.compute_s_per_token * 1e3:>14.4f}  {c.credit:>6.3f}")  # fmt: skip
    measured = {c.tier for c in costs}
    missing = [t for t in TIERS_BELOW if t not in measured]
    if missing:
        lines.append(f"not measured (off, or served nothing): {', '.join(missing)}: "
                     "vllm-router's default kept")  # fmt: skip
    lines.append("")
    lines.append("vllm-router (kv_aware): " + " ".join(credits.flags()))
    lines.append("")
    lines.append("llm-d (precise prefix-cache scorer's parameters):")
    lines.append(llm_d_yaml(credits))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asynchicache fleet credits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running server of ours")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None, help="its admin key, when it has one")
    p.add_argument("--tiers", default=",".join(TIERS_BELOW), help="host,disk,remote")
    p.add_argument("--prompt-words", type=int, default=300, help="words per prompt (~2-3 "
                   "tokens each)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="fresh prompts per tier (median)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in TIERS_BELOW]
    if unknown or args.repeats < 1 or args.prompt_words < 16:
        raise SystemExit(f"asynchicache fleet credits: --tiers from {TIERS_BELOW}, "
                         "--repeats >= 1, --prompt-words >= 16")  # fmt: skip
    probe = Probe(args.url, args.model, args.api_key)
    costs = measure(probe, tiers, args.prompt_words, args.repeats)
    credits = credits_of(costs)
    if args.json:
        print(json.dumps({"tiers": [{**asdict(c), "credit": c.credit} for c in costs],
                          "vllm_router_flags": credits.flags(),
                          "llm_d_kv_cache_backend_configs": llm_d_backends(credits)},
                         indent=2))  # fmt: skip
    else:
        print(report(costs, credits))
    return 0
