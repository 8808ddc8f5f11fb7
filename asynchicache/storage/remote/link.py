"""The remote tier's connection and its health: a circuit breaker and a background prober.

Any transport error trips the breaker (`outage`); while it is open `usable()`
is None and every call of the backend returns at once (the other tiers or a
recompute serve the request). The prober reconnects with exponential backoff
and swaps in a freshly checked `RedisTopology` (slot map and connection
pools) when the server answers again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis.exceptions import ClusterError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from asynchicache.storage.remote.breaker import CircuitBreaker
from asynchicache.storage.remote.resp import RespError
from asynchicache.storage.remote.topology import RedisTopology, RemoteEndpoint

log = logging.getLogger(__name__)

# What "the server is not there" looks like, from our sockets and from redis-py.
OUTAGE = (OSError, RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException)


class RemoteLink:
    """One remote tier endpoint: the current topology, while the breaker is closed."""

    def __init__(
        self,
        endpoint: RemoteEndpoint,
        control_timeout_s: float,
        breaker: CircuitBreaker,
        count: Callable[..., None],
        label: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.breaker = breaker
        self._control_timeout_s = control_timeout_s
        self._count = count
        self._label = label
        self._topology: RedisTopology | None = None
        self._closing = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="redis-probe", daemon=True)
        self._prober.start()

    @property
    def topology(self) -> RedisTopology | None:
        return self._topology

    def usable(self) -> RedisTopology | None:
        """The topology to use now, or None while the tier is down (counted)."""
        topo = self._topology
        if topo is None or not self.breaker.up:
            self._count(skipped_down=1)
            return None
        return topo

    def outage(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if self.breaker.trip(reason):
            log.warning(
                "remote tier %s unavailable (%s); serving without it until it answers again",
                self.endpoint,
                reason,
            )
        self._count(transport_errors=1)

    def refresh_topology(self) -> None:
        topo = self._topology
        if topo is None:
            return
        try:
            topo.refresh()
        except OUTAGE as exc:
            self.outage(exc)

    def close(self) -> None:
        self._closing.set()
        self.breaker.wake()
        self._prober.join(timeout=5.0)
        if self._topology is not None:
            self._topology.close()

    def _probe_loop(self) -> None:
        while self.breaker.wait_probe(self._closing):
            try:
                topo = RedisTopology(self.endpoint, self._control_timeout_s)
            except OUTAGE as exc:
                self._probe_failed(exc)
                continue
            try:
                topo.check()
            except (*OUTAGE, RespError) as exc:
                topo.close()
                self._probe_failed(exc)
                continue
            old, self._topology = self._topology, topo
            if old is not None:
                old.close()
            self.breaker.recovered()
            log.info("remote tier %s available (%s)", self.endpoint, self._label)

    def _probe_failed(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        first = self.breaker.probes_failed == 0 and self.breaker.trips == 0
        self.breaker.probe_failed(reason)
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "remote tier %s not reachable: %s; retrying", self.endpoint, reason)
