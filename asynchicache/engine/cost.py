"""When a cached prefix is worth loading instead of recomputing.

Loading costs bytes / bandwidth of the tier it comes from; recomputing costs
tokens / prefill rate. Both rates are measured as the engine runs (exponential
moving averages), starting from conservative guesses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from asynchicache.config import CacheConfig, PrefetchPolicy


@dataclass
class Rate:
    """An exponential moving average of a throughput."""

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
class CostModel:
    page_bytes: int
    page_size: int
    min_load_tokens: int
    prefill_tok_s: Rate
    host_Bps: Rate
    storage_Bps: Rate

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

    def load_seconds(self, host_pages: int, storage_pages: int) -> float:
        return (
            host_pages * self.page_bytes / self.host_Bps.value
            + storage_pages * self.page_bytes / self.storage_Bps.value
        )

    def recompute_seconds(self, pages: int) -> float:
        return pages * self.page_size / self.prefill_tok_s.value

    def observe_load(self, host_pages: int, storage_pages: int, seconds: float) -> None:
        """A finished load: the bandwidth of the tier it came from."""
        if seconds > 0 and storage_pages == 0 and host_pages:
            self.host_Bps.observe(host_pages * self.page_bytes, seconds)
        elif seconds > 0 and storage_pages:
            self.storage_Bps.observe((host_pages + storage_pages) * self.page_bytes, seconds)

    def worth_loading(self, host_pages: int, storage_pages: int) -> bool:
        pages = host_pages + storage_pages
        if pages * self.page_size < self.min_load_tokens:
            return False
        return self.load_seconds(host_pages, storage_pages) < self.recompute_seconds(pages)


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
