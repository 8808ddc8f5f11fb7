"""Two `asynchicache serve` servers, each with its own cache service, on one disk folder:
B serves A's prompt from the folder (pages A stored after B started), and their writes
together keep the folder under the one `--disk-cache-gb` both were given."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from host_speed import scaled
from serve_process import ServeProcess, shutdown_together, start_together
from settling import settled
from traffic import inventory

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CAPACITY_GIB = 0.1  # 144 default-model page files: one long prompt fits, two do not


def chat(server: ServeProcess, seed: int) -> tuple[str, dict[str, int]]:
    body = {"model": MODEL, "messages": inventory(seed), "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=scaled(300))
    r.raise_for_status()
    out = r.json()
    tiers = out["usage"]["prompt_tokens_details"].get("cached_tokens_by_tier", {})
    return out["choices"][0]["message"]["content"], tiers


def page_files(root: Path) -> list[Path]:
    return list(root.rglob("*.kv"))


def settled_pages(root: Path, at_least: int, timeout_s: float = 120.0) -> int:
    """Wait until the folder holds `at_least` page files and stops changing (stores are async)."""
    return settled(lambda: len(page_files(root)), at_least, "page files", 1.5, timeout_s)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, ...]]:
    root = tmp_path_factory.mktemp("shared")
    flags = ["--disk-cache-dir", str(root / "kv"), "--disk-cache-gb", str(CAPACITY_GIB)]
    flags += ["--device-cache-tokens", "4096", "--host-cache-gb", "0.25"]
    started = [ServeProcess(root / f"{name}.log", *flags) for name in ("a", "b")]
    try:
        start_together(started)  # both running before A stores anything
        yield tuple(started)
    finally:
        codes = shutdown_together(started)
        assert all(code == 0 for code in codes), [s.log_tail() for s in started]


def test_b_serves_the_prompt_a_stored_from_the_shared_folder(
    servers: tuple[ServeProcess, ServeProcess],
) -> None:
    a, b = servers
    root = Path(a.flags[a.flags.index("--disk-cache-dir") + 1])
    text_a, _ = chat(a, seed=0)
    settled_pages(root, at_least=90)
    text_b, tiers = chat(b, seed=0)
    print(f"\nB's tiers for A's prompt: {tiers}")
    assert text_b == text_a
    assert tiers.get("disk", 0) >= 1400, tiers


def test_both_writing_keep_the_folder_under_its_size(
    servers: tuple[ServeProcess, ServeProcess],
) -> None:
    a, b = servers
    root = Path(a.flags[a.flags.index("--disk-cache-dir") + 1])
    capacity = int(CAPACITY_GIB * 2**30)
    # Two new prompts each: ~3x the folder's size in all, and each server alone writes
    # more than the folder holds (~190 of 144 page files), so each must evict. The two
    # servers compute at once (on a slow host four prompts one after another took minutes).
    with ThreadPoolExecutor(2) as pool:
        for seed in range(1, 3):
            list(pool.map(chat, (a, b), (10 * seed, 10 * seed + 1)))
    settled_pages(root, at_least=100)
    used = sum(p.stat().st_size for p in page_files(root))
    print(f"\nfolder: {used / 1e6:.1f} MB of {capacity / 1e6:.1f} MB")
    assert used <= capacity
    for server in (a, b):  # each made room by evicting (its own pages, or the other's)
        stats = httpx.get(server.url + "/cache/stats", timeout=scaled(30))
        disk = stats.json()["storage"]["disk"]
        assert disk["extra"]["folder_bytes"] <= capacity
        assert disk["evictions"] + disk["extra"]["unindexed_evictions"] > 0, disk
