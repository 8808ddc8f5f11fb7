"""The rule every engine follows: load a cached prefix only when loading beats recomputing.

Loading `pages` from the tiers below the engine's own costs, for each tier,
pages x page bytes / that tier's measured bandwidth, plus whatever fixed time
the load adds to the request (`fixed_s`: a scheduler step it waits, a round
trip); recomputing them costs their tokens / the engine's measured prefill
rate. A hit shorter than `min_load_tokens` is recomputed whatever the rates.

Our engine (engine/scheduling/cost.py: L2 host and L3/L4 storage into L1) and the vLLM
connector (integrations/vllm/load_policy.py: L2, disk and remote into vLLM's
blocks) both decide with `LoadCost`, each measuring its own rates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class Rate:
    """An exponential moving average of a throughput (a weight of 0 keeps it fixed)."""

    value: float
    weight: float = 0.2

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        self.value += self.weight * (amount / seconds - self.value)

    def seed(self, amount: float, seconds: float) -> None:
        """Replace the starting guess by a measurement (the engine's warm-up forward)."""
        if seconds > 0 and amount > 0:
            self.value = amount / seconds


@dataclass
class LoadCost:
    """Seconds to load pages from each tier (by name) against seconds to recompute them."""

    page_bytes: int
    page_size: int
    min_load_tokens: int
    prefill_tok_s: Rate
    bandwidth: Mapping[str, Rate]  # bytes/s of each tier a load may come from, fastest first

    def load_seconds(self, pages: Mapping[str, int]) -> float:
        return sum(n * self.page_bytes / self.bandwidth[t].value for t, n in pages.items() if n)

    def recompute_seconds(self, pages: int) -> float:
        return pages * self.page_size / self.prefill_tok_s.value

    def saving_seconds(self, pages: Mapping[str, int], fixed_s: float = 0.0) -> float:
        """What loading saves over recomputing (negative: it costs)."""
        total = sum(pages.values())
        return self.recompute_seconds(total) - self.load_seconds(pages) - fixed_s

    def pays(self, pages: Mapping[str, int], fixed_s: float = 0.0) -> bool:
        """Whether to load `pages` (by tier) rather than recompute them."""
        total = sum(pages.values())
        if total == 0 or total * self.page_size < self.min_load_tokens:
            return False
        return self.saving_seconds(pages, fixed_s) > 0

    def break_even_pages(
        self, tier: str, fixed_s: float = 0.0, per_page_s: float = 0.0
    ) -> int | None:
        """The fewest pages from `tier` whose load pays, each page costing `per_page_s`
        more than its bytes over the tier's bandwidth (None: no count ever pays)."""
        per_page = self.recompute_seconds(1) - self.load_seconds({tier: 1}) - per_page_s
        if per_page <= 0:
            return None
        pages = math.floor(fixed_s / per_page) + 1
        return max(pages, -(-self.min_load_tokens // self.page_size), 1)

    def observe_load(self, pages: Mapping[str, int], seconds: float) -> None:
        """A finished load: its bytes over its time measure the slowest tier it read."""
        tiers = [t for t in self.bandwidth if pages.get(t)]
        if seconds > 0 and tiers:
            self.bandwidth[tiers[-1]].observe(sum(pages.values()) * self.page_bytes, seconds)
