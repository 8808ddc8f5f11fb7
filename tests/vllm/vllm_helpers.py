"""Helpers for the vLLM tests: servers with and without our connector, prompts, metrics."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer, metric_sum
from asynchicache.integrations.vllm.l2.service_process import service_pid
from asynchicache.storage.header import HeaderError, decode_header, peek_header_len

# The remote-tier tests' redis-server wrapper (one definition of it for the suite).
CONNECTOR = "AsynchicacheConnector"
HIT = "vllm:asynchicache_hit_tokens_total"
EVENTS = "vllm:asynchicache_events_total"


def start_all(servers: Sequence[VllmServer]) -> None:
    """Start servers side by side (a vLLM start is mostly waiting on imports and spawns)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(s.start) for s in servers]:
            future.result()


def connector_config(
    disk: Path, socket: str, host_cache_gb: float = 0.5, **more: Any
) -> dict[str, Any]:
    """Our connector's keys with its own folder and service; waits long enough that a
    loaded test machine does not turn hits into misses. `more`: further keys."""
    return {
        "disk_cache_dir": str(disk),
        "cache_service": socket,
        "host_cache_gb": host_cache_gb,
        "lookup_timeout_s": 5.0,
        "prefetch_timeout_s": 30.0,
        **more,
    }


def server(flags: VllmFlags, log: Path) -> VllmServer:
    return VllmServer(flags, log, python=sys.executable)


def prompt(seed: int, n: int) -> list[int]:
    """`n` random token ids (no special tokens) for the tiny model."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def text_of(s: VllmServer, tokens: Sequence[int] | str, **extra: Any) -> str:
    return s.complete(list(tokens) if not isinstance(tokens, str) else tokens, **extra)["choices"][
        0
    ]["text"]


def hits(s: VllmServer, tier: str) -> float:
    return metric_sum(s.metrics(), HIT, tier=tier)


def event(s: VllmServer, name: str) -> float:
    return metric_sum(s.metrics(), EVENTS, event=name)


def wait_for(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll `check` until true (stats reach /metrics a moment after the response)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.2)


def stored_since(s: VllmServer, before: float) -> float:
    """Pages stored since `before`. Stores finish after the step that saved them, and
    vLLM collects connector stats only when it steps: a tiny request makes it step."""
    s.complete([1, 2, 3], max_tokens=1)
    return event(s, "pages_stored") - before


def hit_after(s: VllmServer, tier: str, before: float, at_least: float) -> float:
    """Wait until `tier`'s hit counter grew by `at_least`; returns the growth. Like
    `stored_since`, each look makes vLLM step first (a tiny request: shorter than a page,
    so it hits nothing): a load's stats reach /metrics only with a later step."""

    wait_for(
        lambda: stepped_hits(s, tier) - before >= at_least, what=f"{at_least} {tier} hit tokens"
    )
    return hits(s, tier) - before


def stepped_hits(s: VllmServer, tier: str) -> float:
    """`tier`'s hit counter after making vLLM step once (see `hit_after`)."""
    s.complete([1, 2, 3], max_tokens=1)
    return hits(s, tier)


def page_files(folder: Path, tokens: Sequence[int], page: int = 16) -> dict[int, list[Path]]:
    """The page files under `folder` that hold pages of `tokens`, by page number, found by
    the token ids in their headers (one page of tokens has a file per namespace, salt or
    adapter). Files are named by hashes a test cannot make without the instance's
    namespace, and "the files new since" also catches other prompts' stores that land
    late on a loaded machine."""
    pages = {tuple(tokens[i * page : (i + 1) * page]): i for i in range(len(tokens) // page)}
    found: dict[int, list[Path]] = {}
    for path in folder.rglob("*.kv"):
        try:
            with path.open("rb") as f:
                head = f.read(4096)
                size = peek_header_len(head)
                head += f.read(max(0, size - len(head)))
            tokens_in = decode_header(memoryview(head)[:size]).tokens
        except (HeaderError, OSError):
            continue  # a file being written, or one a test broke
        if tokens_in in pages:
            found.setdefault(pages[tokens_in], []).append(path)
    return found


def kill_service(address: str) -> int:
    """SIGKILL the cache service serving `address` (as a crash would); returns its pid."""
    pid = service_pid(address)
    assert pid is not None, f"no service pid recorded for {address}"
    os.kill(pid, signal.SIGKILL)
    return pid
