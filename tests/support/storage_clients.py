"""Storage clients for the tests that talk to a real cache service, and waits on its state."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from host_speed import scaled
from pools import NAMESPACE, Pool

from asynchicache.storage.client.storage_client import ClientConfig, StorageClient

Clients = Callable[..., StorageClient]


def client_factory() -> Iterator[Clients]:
    """Yields `make(address, pool, ready_s=None, **config)`: a client of the service at
    `address` on `pool` (connected when `ready_s` is given); all are closed after."""
    made: list[StorageClient] = []

    def make(address: str, pool: Pool, ready_s: float | None = None, **kw: object) -> StorageClient:
        cfg = ClientConfig(address, NAMESPACE, pool.segment.name, pool.layout, **kw)  # type: ignore[arg-type]
        made.append(StorageClient(cfg))
        if ready_s is not None:
            assert made[-1].wait_ready(ready_s), f"no service at {address}"
        return made[-1]

    yield make
    for c in made:
        c.close()


def wait_idle(client: StorageClient, timeout_s: float = 60.0) -> None:
    """Until the service runs no job (its late work, if any, is over; `timeout_s` scaled
    to this host)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        stats = client.stats(5.0)
        if stats is not None and stats.service.get("running", 1) == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the service never became idle")
