"""Frozen, validated configuration, split by concern.

Each dataclass validates itself in `__post_init__` and names the CLI flag that
was wrong. Derived values are properties; nothing mutates a config once built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class WritePolicy(StrEnum):
    """When L1 pages are copied to L2 (names as in SGLang HiCache)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PrefetchPolicy(StrEnum):
    """How long a request waits for its L3/L4 prefix before it prefills."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


def default_disk_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asynchicache" / "kv"


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """The tiers: sizes, policies and where they live."""

    page_size: int = 16
    device_cache_tokens: int = 16384
    host_cache_gb: float = 2.0
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 2.0
    enable_prefix_cache: bool = True
    enable_host_cache: bool = True
    disk_cache_dir: Path | None = field(default_factory=default_disk_cache_dir)
    disk_cache_gb: float = 20.0
    disk_admit_hits: int = 0
    disk_admit_tokens: int = 0
    remote_url: str | None = None
    remote_ttl_s: int | None = None

    def __post_init__(self) -> None:
        _positive("--page-size", self.page_size)
        _positive("--device-cache-tokens", self.device_cache_tokens)
        _non_negative("--host-cache-gb", self.host_cache_gb)
        _positive("--disk-cache-gb", self.disk_cache_gb)
        _non_negative("--disk-admit-hits", self.disk_admit_hits)
        _non_negative("--disk-admit-tokens", self.disk_admit_tokens)
        _positive("--write-through-threshold", self.write_through_threshold)
        _positive("--prefetch-timeout", self.prefetch_timeout_s)
        if self.device_cache_tokens < self.page_size:
            raise ValueError(
                f"--device-cache-tokens ({self.device_cache_tokens}) must hold at least "
                f"one page of --page-size ({self.page_size}) tokens"
            )
        if not isinstance(self.write_policy, WritePolicy):
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        if not isinstance(self.prefetch_policy, PrefetchPolicy):
            object.__setattr__(self, "prefetch_policy", PrefetchPolicy(self.prefetch_policy))

    @property
    def device_pages(self) -> int:
        return self.device_cache_tokens // self.page_size

    @property
    def disk_enabled(self) -> bool:
        return self.enable_prefix_cache and self.disk_cache_dir is not None

    @property
    def host_enabled(self) -> bool:
        return self.enable_prefix_cache and self.enable_host_cache and self.host_cache_gb > 0
