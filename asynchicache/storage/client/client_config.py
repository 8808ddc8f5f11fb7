"""How an engine reaches the cache service (`StorageClient`'s configuration)."""

from __future__ import annotations

from dataclasses import dataclass

from asynchicache.common.curve import ClientCurve
from asynchicache.storage.base import PageLayout


@dataclass(frozen=True)
class ClientConfig:
    """How an engine reaches the cache service and what it registers there."""

    address: str
    namespace: bytes = b""  # Namespace.encode() of the model's pages
    segment: str = ""  # name of the L2 pool's shared-memory segment
    layout: PageLayout | None = None  # one page of that pool
    ticket_timeout_s: float = 10.0
    exists_timeout_s: float = 0.05
    heartbeat_s: float = 1.0
    reconnect_ms: int = 100
    events: bool = False  # receive the namespace's L3/L4 KV events (take_events())
    curve: ClientCurve | None = None  # a tcp:// service's public key and our certificate

    def __post_init__(self) -> None:
        if self.ticket_timeout_s <= 0 or self.exists_timeout_s <= 0:
            raise ValueError("storage client timeouts must be positive")

    @property
    def has_pool(self) -> bool:
        return bool(self.namespace and self.segment and self.layout is not None)
