"""Helpers for the live cache-operation tests: requests by token ids, waiting for quiet,
a KV event subscriber that also remembers each page's chain, and the truth it must match."""

from __future__ import annotations

import time
from typing import Any

import httpx

from asynchicache.common.tiers import TIERS
from asynchicache.kv_events import wire
from asynchicache.kv_events.subscriber import KvEventSubscriber

PAGE = 16


def prompt(seed: int, pages: int) -> list[int]:
    """Token ids of `pages` full pages, distinct per seed from the first token on."""
    return [1000 + (seed * 7919 + i * 31) % 40000 for i in range(pages * PAGE)]


def complete(url: str, ids: list[int], **extra: Any) -> dict[str, int]:
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def lookup(url: str, ids: list[int], salt: str | None = None) -> dict[str, int]:
    body: dict[str, Any] = {"prompt": ids}
    if salt:
        body["cache_salt"] = salt
    r = httpx.post(url + "/cache/lookup", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["cached_tokens_by_tier"]


def stats(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/cache/stats", timeout=60)
    r.raise_for_status()
    return r.json()


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Until no request runs and no copy or storage ticket is pending in the engine."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(url)
        cache = s["cache"]
        if (
            not any(s["queues"].values())
            and not cache["pending_transfers"]
            and not cache["pending_storage"]
        ):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not go idle: {s['queues']}, {cache}")
        time.sleep(0.1)


class ChainSubscriber(KvEventSubscriber):
    """A subscriber that also remembers each page's parent and tokens (to find a prompt's
    pages among the hashes, as a router does)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        # (parent, tokens) -> hash; a first page's parent is None on the wire
        self.pages: dict[tuple[int | None, tuple[int, ...]], int] = {}
        super().__init__(endpoint, replay)

    def _apply(self, number: int, batch: wire.KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, wire.BlockStored) and len(e.token_ids) == PAGE * len(e.block_hashes):
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self.pages[(parent, tuple(e.token_ids[i * PAGE : (i + 1) * PAGE]))] = h
                    parent = h
        super()._apply(number, batch)

    def chain(self, ids: list[int]) -> list[int]:
        """The block hashes of the prompt's pages seen in events (from its first page on)."""
        out: list[int] = []
        parent: int | None = None
        for k in range(len(ids) // PAGE):
            h = self.pages.get((parent, tuple(ids[k * PAGE : (k + 1) * PAGE])))
            if h is None:
                break
            out.append(h)
            parent = h
        return out

    def expected_lookup(self, ids: list[int]) -> dict[str, int]:
        """What `/cache/lookup` must say, from the tiers' page sets: L1 then L2 along the
        tree's path, then disk and remote for the pages after it."""
        hashes = self.chain(ids)
        t = self.tiers
        k = 0
        out = dict.fromkeys(TIERS, 0)
        for tier, members in (("device", t["device"]), ("host", t["device"] | t["host"])):
            while k < len(hashes) and hashes[k] in members:
                out[tier] += PAGE
                k += 1
        for tier in ("disk", "remote"):
            while k < len(hashes) and hashes[k] in t[tier]:
                out[tier] += PAGE
                k += 1
        return out


def follow(sub: KvEventSubscriber, truth: Any, timeout_s: float = 60.0) -> dict[str, int]:
    """Poll the subscriber until its per-tier counts equal `truth()` (which is re-read)."""
    deadline = time.monotonic() + timeout_s
    want: dict[str, int] = {}
    while time.monotonic() < deadline:
        sub.poll(200)
        want = truth()
        if sub.synced and sub.counts() == want:
            return want
    raise AssertionError(f"the subscriber holds {sub.counts()}, the server {want}")
