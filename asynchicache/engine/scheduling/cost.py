"""When a cached prefix is worth loading instead of recomputing, in our engine.

Loading costs bytes / bandwidth of the tier it comes from; recomputing costs
tokens / prefill rate. Both rates are measured as the engine runs (exponential
moving averages), starting from conservative guesses. The rule itself is
hierarchy/load_cost.py's, shared with the vLLM connector.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from asynchicache.hierarchy.load_cost import LoadCost, Rate
from asynchicache.settings.config import CacheConfig, PrefetchPolicy

__all__ = ["CostModel", "Rate", "load_deadline"]


HOST, STORAGE = "host", "storage"  # the engine's tiers below L1, fastest first


@dataclass
class Mean:
    """An exponential moving average of a duration (0 until the first observation)."""

    value: float = 0.0
    weight: float = 0.2

    def observe(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.value = (
            seconds if self.value <= 0 else self.value + self.weight * (seconds - self.value)
        )


FIT_WINDOW = 32  # prompt steps the fixed-cost fit looks back on
FIT_MIN_STEPS = 8


@dataclass
class StepFit:
    """A prompt step's fixed cost: `seconds = fixed_s + tokens * per_token`, fitted by
    least squares over the last `FIT_WINDOW` prompt steps. With busy cores it is what
    a decodes-only step does not show: those may run on fewer threads (engine/threads.py),
    while a prompt step's threads wait at OpenMP's barriers for descheduled siblings."""

    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=FIT_WINDOW))

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.steps.append((tokens, seconds))

    @property
    def fixed_s(self) -> float:
        """The fit's intercept, within [0, the quickest step's time]; 0 until the steps
        seen are enough and of different enough sizes (the longest twice the shortest)."""
        if len(self.steps) < FIT_MIN_STEPS:
            return 0.0
        xs = [float(n) for n, _ in self.steps]
        ys = [s for _, s in self.steps]
        if max(xs) < 2 * min(xs):
            return 0.0
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        return min(min(ys), max(0.0, my - slope * mx))


@dataclass
class CostModel:
    """The engine's rates, decided by the shared rule (hierarchy/load_cost.py's `LoadCost`)."""

    page_bytes: int
    page_size: int
    min_load_tokens: int
    prefill_tok_s: Rate
    host_Bps: Rate
    storage_Bps: Rate
    # A forward of the decodes alone: what every step costs whatever its prompt tokens
    # (reading the weights; with busy cores, OpenMP's barriers),
    # engine/scheduling/prefill_policy.py.
    small_step_s: Mean = field(default_factory=Mean)
    prompt_steps: StepFit = field(default_factory=StepFit)

    @property
    def step_fixed_s(self) -> float:
        """What a step costs whatever its prompt tokens: the larger of the two views."""
        return max(self.small_step_s.value, self.prompt_steps.fixed_s)

    @classmethod
    def initial(cls, page_bytes: int, page_size: int, min_load_tokens: int) -> CostModel:
        return cls(
            page_bytes=page_bytes,
            page_size=page_size,
            min_load_tokens=min_load_tokens,
            prefill_tok_s=Rate(300.0),
            host_Bps=Rate(2e9),
            storage_Bps=Rate(3e8),
        )

    @property
    def rule(self) -> LoadCost:
        """The shared rule over this model's rates (the same `Rate` objects)."""
        bandwidth = {HOST: self.host_Bps, STORAGE: self.storage_Bps}
        return LoadCost(
            self.page_bytes, self.page_size, self.min_load_tokens, self.prefill_tok_s, bandwidth
        )

    def load_seconds(self, host_pages: int, storage_pages: int) -> float:
        return self.rule.load_seconds({HOST: host_pages, STORAGE: storage_pages})

    def recompute_seconds(self, pages: int) -> float:
        return self.rule.recompute_seconds(pages)

    def observe_load(self, host_pages: int, storage_pages: int, seconds: float) -> None:
        """A finished load: the bandwidth of the tier it came from."""
        self.rule.observe_load({HOST: host_pages, STORAGE: storage_pages}, seconds)

    def worth_loading(self, host_pages: int, storage_pages: int) -> bool:
        return self.rule.pays({HOST: host_pages, STORAGE: storage_pages})


def load_deadline(config: CacheConfig, cost: CostModel, pages: int) -> float | None:
    """When a request stops waiting for a load of `pages` pages, by --prefetch-policy.

    wait_complete: until the load ends (the storage client's own timeout bounds
    it); timeout: --prefetch-timeout plus --prefetch-timeout-per-ki-token for each
    1,024 tokens of the load (SGLang's linear timeout); best_effort: never longer than
    recomputing those pages would take, so a slow tier cannot make a request
    later than no cache at all.
    """
    policy = config.prefetch_policy
    if policy is PrefetchPolicy.WAIT_COMPLETE:
        return None
    if policy is PrefetchPolicy.TIMEOUT:
        per_ki = config.prefetch_timeout_per_ki_token_s * pages * config.page_size / 1024
        return time.monotonic() + config.prefetch_timeout_s + per_ki
    return time.monotonic() + max(0.05, cost.recompute_seconds(pages))
