"""Pins on a live server: a pinned prompt is still served from L2/L3 after a workload that
evicts everything else (the same workload evicts an unpinned control prompt), and after a
restart on the same folder (the pin, read back from the folder, still holds off a workload
that evicts the control); pins expire after their TTL, are listed in /cache/stats, and a
pin past --max-pinned-fraction is refused with 409."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cache_ops_helpers import PAGE, complete, lookup, prompt, stats, wait_idle
from serve_process import ServeProcess, disk_server
from settling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# L1 32 pages, L2 36 pages (pins may take 18), disk 72 page files (pins may take 36): small
# tiers, so a short workload (ten prompts of PAGES) evicts everything that is not pinned.
FLAGS = ("--device-cache-tokens", "512", "--host-cache-gb", "0.025", "--disk-cache-gb", "0.05")
PAGES = 10
PINNED, CONTROL = prompt(1, PAGES), prompt(2, PAGES)


def _server(root: Path) -> ServeProcess:
    return disk_server(root / "kv", root / "server.log", *FLAGS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pins")


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServeProcess]:
    srv = _server(folder)
    srv.start()
    try:
        yield srv
    finally:
        srv.shutdown()


def _pin(url: str, ids: list[int], **extra: object) -> httpx.Response:
    return httpx.post(url + "/cache/pin", json={"prompt": ids, **extra}, timeout=600)


def _pinned_ids(url: str) -> set[str]:
    return {p["pin_id"] for p in stats(url)["pins"]["pinned"]}


def test_a_pinned_prompt_outlives_a_workload_that_evicts_its_control(
    server: ServeProcess,
) -> None:
    url = server.url
    complete(url, CONTROL)
    complete(url, PINNED)
    r = _pin(url, PINNED)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["pages"] == PAGES and not pin["computed"] and pin["persistent"]
    assert pin["pin_id"] in _pinned_ids(url)
    for k in range(10):  # 100 pages through L1 (32), L2 (36) and the disk (72)
        complete(url, prompt(10 + k, PAGES))
    wait_idle(url)
    assert sum(lookup(url, CONTROL).values()) == 0  # without a pin: gone from every tier
    kept = lookup(url, PINNED)
    assert kept["host"] + kept["disk"] > 0 and sum(kept.values()) == PAGES * PAGE, kept
    served = complete(url, PINNED)
    assert sum(served.values()) >= (PAGES - 1) * PAGE, served
    assert served["host"] + served["disk"] > 0, served  # from L2/L3, not L1
    assert sum(complete(url, CONTROL).values()) == 0


def test_ttl_listing_and_the_limit(server: ServeProcess) -> None:
    url = server.url
    short = prompt(3, 4)
    r = _pin(url, short, ttl_s=2)  # not cached yet: computed first
    assert r.status_code == 200 and r.json()["computed"], r.text
    assert r.json()["pin_id"] in _pinned_ids(url)
    pin_id = r.json()["pin_id"]
    wait_until(lambda: pin_id not in _pinned_ids(url), "the pin to expire", 60)
    big = _pin(url, prompt(4, 20))  # 10 pinned + 20 > 18 of L2's 36 pages
    assert big.status_code == 409, big.text
    assert "--max-pinned-fraction" in big.json()["error"]["message"]
    assert stats(url)["pins"]["pinned_pages"] == PAGES


def test_the_pin_survives_a_restart(folder: Path, server: ServeProcess) -> None:
    server.shutdown()
    again = _server(folder)
    again.start()
    try:
        (pin_id,) = _pinned_ids(again.url)  # read back from the folder
        assert lookup(again.url, PINNED)["disk"] == PAGES * PAGE
        assert lookup(again.url, CONTROL)["disk"] > 0  # stored again by the first test
        for k in range(10):  # the pin read back from the folder still holds off eviction
            complete(again.url, prompt(40 + k, PAGES))
        wait_idle(again.url)
        assert sum(lookup(again.url, CONTROL).values()) == 0
        served = complete(again.url, PINNED)
        assert served["host"] + served["disk"] >= (PAGES - 1) * PAGE, served
        r = httpx.post(again.url + "/cache/unpin", json={"pin_id": pin_id}, timeout=60)
        assert r.json()["removed"] == 1 and _pinned_ids(again.url) == set()
    finally:
        again.shutdown()
