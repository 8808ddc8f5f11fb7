"""The server configurations a sweep compares, and how their tiers are sized.

L1 is sized so that the workload's working set (the distinct full prompt pages
an unbounded cache would hold) is about `l1_ratio` times L1, and L2 to
`l2_ratio` times L1 so that it cannot hold the working set either: only a
tier below L2 can keep every prefix. L1 is never smaller than the largest
request (prompt + answer) plus two pages, or that request could not run.

L1 also holds the KV of the running requests; the engine admits a request only
when L1 can hold it (engine/scheduling/memory_budget.py), so no cap on running requests is
needed (`--max-running-requests` passes one through when asked for).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

GiB = 2**30


@dataclass(frozen=True)
class Setup:
    """Which tiers are on."""

    name: str  # for tables and plots, e.g. "L1+L2+L3"
    slug: str  # for folder names, e.g. "l1-l2-l3"
    prefix_cache: bool
    host: bool
    disk: bool
    remote: bool

    @property
    def persistent(self) -> bool:
        """Does anything survive a server restart?"""
        return self.disk or self.remote


SETUPS: Mapping[str, Setup] = MappingProxyType(
    {
        s.slug: s
        for s in (
            Setup("no prefix cache", "no-cache", False, False, False, False),
            Setup("L1", "l1", True, False, False, False),
            Setup("L1+L2", "l1-l2", True, True, False, False),
            Setup("L1+L2+L3", "l1-l2-l3", True, True, True, False),
            Setup("L1+L2+L3+L4", "l1-l2-l3-l4", True, True, True, True),
        )
    }
)


def pick_setups(slugs: Sequence[str] | None, remote_url: str | None) -> list[Setup]:
    """The setups asked for (default: all; L4 only with a Redis URL)."""
    chosen = list(slugs) if slugs else [s for s in SETUPS if s != "l1-l2-l3-l4" or remote_url]
    unknown = [s for s in chosen if s not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setups {unknown}; known: {', '.join(SETUPS)}")
    if "l1-l2-l3-l4" in chosen and not remote_url:
        raise ValueError("the l1-l2-l3-l4 setup needs --remote-url")
    return [SETUPS[s] for s in chosen]


@dataclass(frozen=True)
class Sizing:
    """Tier sizes, in tokens, for one workload."""

    page_size: int
    working_set_tokens: int
    largest_request_tokens: int
    device_cache_tokens: int
    host_cache_tokens: int
    max_running_requests: int | None = None  # None: the engine's default

    @property
    def working_set_over_l1(self) -> float:
        return self.working_set_tokens / self.device_cache_tokens


def _pages_up(tokens: float, page_size: int) -> int:
    return max(1, math.ceil(tokens / page_size)) * page_size


def size_tiers(
    working_set_tokens: int,
    largest_request_tokens: int,
    page_size: int,
    l1_ratio: float = 4.0,
    l2_ratio: float = 2.0,
) -> Sizing:
    if l1_ratio <= 0 or l2_ratio <= 0:
        raise ValueError("--l1-ratio and --l2-ratio must be positive")
    floor = _pages_up(largest_request_tokens, page_size) + 2 * page_size
    l1 = max(_pages_up(working_set_tokens / l1_ratio, page_size), floor)
    l2 = _pages_up(l1 * l2_ratio, page_size)
    return Sizing(page_size, working_set_tokens, largest_request_tokens, l1, l2)


@dataclass(frozen=True)
class ServerPlan:
    """Everything a setup's server command line depends on."""

    sizing: Sizing
    kv_bytes_per_token: int
    disk_dir: Path
    remote_url: str | None = None
    remote_ttl_s: int = 3600
    extra: tuple[str, ...] = ()  # --server-arg pass-through


def server_flags(setup: Setup, plan: ServerPlan) -> list[str]:
    """`asynchicache serve` flags (all but --port) for `setup`."""
    s = plan.sizing
    flags = [
        "--page-size",
        str(s.page_size),
        "--device-cache-tokens",
        str(s.device_cache_tokens),
        "--disk-cache-dir",
        str(plan.disk_dir),
        # INFO: the engine then logs each load it gave up on, and why (server_log.py).
        "--log-level",
        "info",
    ]
    if s.max_running_requests is not None:
        flags += ["--max-running-requests", str(s.max_running_requests)]
    if not setup.prefix_cache:
        flags.append("--no-prefix-cache")
    if setup.host:
        # GiB, as the host pool counts them: exactly host_cache_tokens of KV.
        # Rounded up so that the pool's floor division does not lose a page.
        gb = math.ceil(s.host_cache_tokens * plan.kv_bytes_per_token / GiB * 1e9) / 1e9
        flags += ["--host-cache-gb", f"{gb:.9f}"]
    else:
        flags.append("--no-host-cache")
    if not setup.disk:
        flags.append("--no-disk-cache")
    if setup.remote:
        if plan.remote_url is None:
            raise ValueError(f"setup {setup.name} needs a remote URL")
        flags += ["--remote-url", plan.remote_url, "--remote-ttl-s", str(plan.remote_ttl_s)]
    return flags + list(plan.extra)
