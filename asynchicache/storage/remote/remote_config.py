"""The remote tier's configuration (one namespace's store) and its key prefix."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from asynchicache.storage.base import PageLayout
from asynchicache.storage.page_keys import PageKeys
from asynchicache.storage.remote.topology import RemoteEndpoint, parse_remote_url


def remote_key_prefix(namespace: bytes, layout: PageLayout) -> bytes:
    """The key prefix of one namespace and page layout: the same in every process."""
    ident = b"\x00".join(
        (b"asynchicache-remote", namespace, layout.dtype.encode(), repr(layout.shape).encode())
    )
    return b"ackv:" + xxhash.xxh3_64_hexdigest(ident).encode() + b":"


@dataclass(frozen=True)
class RedisConfig:
    """One namespace's remote store."""

    url: str
    namespace: bytes
    layout: PageLayout
    ttl_s: int | None = None  # None: no expiry (rely on the server's maxmemory-policy)
    cluster: bool | None = None  # None: from the URL (redis+cluster://, ?cluster=true)
    io_threads: int = 4
    batch_pages: int = 4  # pages per pipelined round trip on one connection
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 2.0  # per send/recv of page traffic
    page_timeout_s: float = 2.0  # one page's whole GET reply, however it trickles in
    control_timeout_s: float = 0.5  # EXISTS and friends (the service's loop waits on these)
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    keys: PageKeys | None = None  # --cache-key-file: values carry a keyed MAC (page_keys.py)

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("the remote tier needs a non-empty namespace")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"--remote-ttl-s must be positive seconds, got {self.ttl_s}")
        if self.io_threads <= 0 or self.batch_pages <= 0:
            raise ValueError("remote io_threads and batch_pages must be positive")
        timeouts = (self.connect_timeout_s, self.socket_timeout_s, self.control_timeout_s)
        if min(*timeouts, self.page_timeout_s) <= 0:
            raise ValueError("remote timeouts must be positive")
        parse_remote_url(self.url, self.cluster)  # a bad URL fails here, naming the flag

    @property
    def endpoint(self) -> RemoteEndpoint:
        return parse_remote_url(
            self.url, self.cluster, self.connect_timeout_s, self.socket_timeout_s
        )
