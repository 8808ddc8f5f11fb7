"""Two (or more) of our servers behind a real vllm-router (`kv_aware`, fed their KV events),
for the fleet tests: `prompt` makes distinct page-aligned texts, `send` posts a completion
to one server or to the router, `routed` waits until the router credits a prompt somewhere."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from ports import free_port
from redis_server import RedisServer, redis_server_binary
from serve_process import ServeProcess, shutdown_together, start_together

from asynchicache.bench.fleet.fleet_router import Decision, RouterConfig, VllmRouter, Worker

PAGE = 16


@dataclass
class Instance:
    server: ServeProcess
    worker: Worker

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Fleet:
    instances: list[Instance]
    router: VllmRouter

    def by_url(self, url: str) -> Instance:
        return next(i for i in self.instances if i.url == url)

    def route(self, text: str, **extra: Any) -> tuple[Decision, dict[str, int]]:
        """Send `text` through the router; (its decision for it, the usage's cached tokens
        by tier, as the instance that served it reports them)."""
        seen = len(self.router.decisions())
        usage = send(self.router.url, text, **extra)
        deadline = time.monotonic() + 10
        while len(decisions := self.router.decisions()) <= seen:
            assert time.monotonic() < deadline, "the router logged no decision"
            time.sleep(0.05)
        return decisions[seen], usage


def _until_routed(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            send(url, "hello")
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def prompt(seed: int, words: int = 300) -> str:
    """A text of a few hundred tokens, distinct per seed from its first word on."""
    return " ".join(f"w{seed}x{i}" for i in range(words))


def tokens(url: str, text: str) -> list[int]:
    """The ids `text` is as a completion prompt on the server at `url`."""
    body = {"model": "smollm", "prompt": text, "add_special_tokens": False}
    r = httpx.post(url + "/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def clear(url: str, *tiers: str) -> None:
    r = httpx.post(url + "/cache/clear", json={"scope": list(tiers)}, timeout=120)
    r.raise_for_status()


def lookup(url: str, text: str) -> dict[str, int]:
    """Prompt tokens of `text` each tier holds (the instance's own answer)."""
    body = {"model": "smollm", "prompt": text}
    r = httpx.post(url + "/cache/lookup", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["cached_tokens_by_tier"]


def send(url: str, text: str, **extra: Any) -> dict[str, int]:
    body = {"model": "smollm", "prompt": text, "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


@contextmanager
def fleet(
    root: Path,
    n: int = 2,
    flags: Sequence[str] = (),
    config: RouterConfig | None = None,
    per_instance: Callable[[int], Sequence[str]] = lambda k: (),
) -> Iterator[Fleet]:
    """`n` servers (`--served-model-name smollm`, KV events on loopback tcp: vllm-router
    takes nothing else; `flags`, then `per_instance(k)`) and a router in front of them."""
    instances = []
    for k in range(n):
        ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        server = ServeProcess(
            root / f"server{k}.log", "--served-model-name", "smollm", "--kv-events-endpoint",
            ev, "--kv-events-replay-endpoint", rep, "--kv-events-plaintext", *flags,
            *per_instance(k),
        )  # fmt: skip
        instances.append(Instance(server, Worker("", ev, rep)))
    router = None
    try:
        start_together([i.server for i in instances])
        for i in instances:
            i.worker = Worker(i.url, i.worker.events, i.worker.replay)
        workers = [i.worker for i in instances]
        router = VllmRouter(config or RouterConfig(), workers, root / "router.log")
        router.start()
        _until_routed(router.url)  # its /health answers before its workers are in
        time.sleep(1.0)  # its subscriptions take hold (a SUB misses what came before)
        yield Fleet(instances, router)
    finally:
        if router is not None:
            router.stop()
        shutdown_together([i.server for i in instances])


@contextmanager
def fleet_on_redis(
    root: Path, flags: Sequence[str] = (), config: RouterConfig | None = None
) -> Iterator[Fleet]:
    """`fleet` of two servers sharing a real Redis as L4 (`flags`, then `--remote-url`), each
    with its own disk folder under `root`."""
    rds = RedisServer(redis_server_binary(), root / "redis").start()
    try:
        with fleet(
            root,
            flags=(*flags, "--remote-url", rds.url),
            config=config,
            per_instance=lambda k: ("--disk-cache-dir", str(root / f"kv{k}")),
        ) as made:
            yield made
    finally:
        rds.stop()
