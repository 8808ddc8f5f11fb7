"""Where each key of the remote tier lives, and the connections to get there.

A `RedisTopology` is one connected view of the remote tier: a redis-py client
(`redis.Redis` for one node, `redis.cluster.RedisCluster` for a cluster) for
small commands (EXISTS, EXPIRE, UNLINK, SCAN), the mapping from a key to the
node that owns its slot, and a pool of `RespConnection`s per node for page
traffic. It is built by the remote backend's prober and replaced as a whole
when the tier comes back after an outage.

redis-py's own retries are switched off (`Retry(NoBackoff(), 0)`): a failed
command must reach the backend's circuit breaker at once, not after seconds of
reconnect attempts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from asynchicache.storage.remote.resp import ConnectionParams, NodeAddress, RespConnection, command

log = logging.getLogger(__name__)

_SCHEMES = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
    "valkey": (False, False),
    "valkeys": (True, False),
    "valkey+cluster": (False, True),
    "valkeys+cluster": (True, True),
}
_QUERY_KEYS = ("cluster", "ssl_cert_reqs", "ssl_ca_certs")
_IDLE_PER_NODE = 16
_REFRESH_EVERY_S = 1.0


@dataclass(frozen=True)
class RemoteEndpoint:
    """A parsed `--remote-url`: the seed node, whether it is a cluster, how to connect."""

    seed: NodeAddress
    cluster: bool
    params: ConnectionParams

    def __str__(self) -> str:
        scheme = "rediss" if self.params.tls else "redis"
        return f"{scheme}{'+cluster' if self.cluster else ''}://{self.seed}/{self.params.db}"


def parse_remote_url(
    url: str,
    cluster: bool | None = None,
    connect_timeout_s: float = 0.5,
    socket_timeout_s: float = 2.0,
) -> RemoteEndpoint:
    """Parse redis[s][+cluster]://[user:password@]host[:port][/db][?cluster=true&ssl_cert_reqs=none].

    `cluster` overrides what the URL says. Raises ValueError naming the problem.
    """
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"--remote-url must start with one of {sorted(_SCHEMES)}, got {url.split(':')[0]!r}"
        )
    tls, is_cluster = _SCHEMES[parts.scheme]
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - set(_QUERY_KEYS))
    if unknown:
        raise ValueError(f"--remote-url: unknown options {unknown}; known: {list(_QUERY_KEYS)}")
    if "cluster" in query:
        is_cluster = query["cluster"].lower() in ("1", "true", "yes")
    if cluster is not None:
        is_cluster = cluster
    if not parts.hostname:
        raise ValueError(f"--remote-url needs a host: {url!r}")
    try:
        port = parts.port or 6379
        db = int(parts.path.strip("/") or 0)
    except ValueError as exc:
        raise ValueError(f"--remote-url: bad port or database number in {url!r}") from exc
    if is_cluster and db:
        raise ValueError("--remote-url: a Redis Cluster has only database 0")
    params = ConnectionParams(
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        db=db,
        tls=tls,
        tls_verify=query.get("ssl_cert_reqs", "required").lower() != "none",
        tls_ca_file=query.get("ssl_ca_certs"),
        connect_timeout_s=connect_timeout_s,
        socket_timeout_s=socket_timeout_s,
    )
    return RemoteEndpoint(NodeAddress(parts.hostname, port), is_cluster, params)


class RedisTopology:
    """One connected view of the remote tier (see the module docstring). Thread-safe."""

    def __init__(self, endpoint: RemoteEndpoint, control_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.client = _control_client(endpoint, control_timeout_s)
        self._idle: dict[NodeAddress, list[RespConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._refresh_lock = threading.Lock()
        self._refreshed = 0.0

    def node_of(self, key: bytes) -> NodeAddress:
        if not isinstance(self.client, RedisCluster):
            return self.endpoint.seed
        node = self.client.get_node_from_key(key)
        return NodeAddress(node.host, int(node.port))

    def nodes(self) -> list[NodeAddress]:
        """The primaries holding data (one for a single node)."""
        if not isinstance(self.client, RedisCluster):
            return [self.endpoint.seed]
        return [NodeAddress(n.host, int(n.port)) for n in self.client.get_primaries()]

    def check(self) -> None:
        """PING every primary over a data connection (auth included); raises on failure."""
        for node in self.nodes():
            with self.connection(node) as conn:
                conn.send([command(b"PING")])
                conn.read_status()

    def refresh(self) -> None:
        """Re-read the slot map after a MOVED reply (a resharded or failed-over cluster).

        Every batch that met the move asks; one re-read per second is enough.
        """
        if not isinstance(self.client, RedisCluster):
            return
        with self._refresh_lock:
            if time.monotonic() - self._refreshed < _REFRESH_EVERY_S:
                return
            self._refreshed = time.monotonic()
            self.client.nodes_manager.initialize()

    @contextlib.contextmanager
    def connection(self, node: NodeAddress, fresh: bool = False) -> Iterator[RespConnection]:
        """A data connection to `node` (a new one if `fresh`), back to the pool unless the
        block raised."""
        conn = None
        if not fresh:
            with self._lock:
                idle = self._idle.get(node)
                conn = idle.pop() if idle else None
        if conn is None:
            conn = RespConnection(node, self.endpoint.params)
        conn.uses += 1
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            idle = self._idle.setdefault(node, [])
            if self._closed or len(idle) >= _IDLE_PER_NODE:
                conn.close()
            else:
                idle.append(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()
        with contextlib.suppress(Exception):
            self.client.close()


def admin_client(endpoint: RemoteEndpoint, timeout_s: float = 30.0) -> redis.Redis | RedisCluster:
    """A redis-py client for long administrative commands (SCAN walks, bulk UNLINK): its
    own connections and a long timeout, so it never trips the page traffic's breaker."""
    return _control_client(endpoint, timeout_s)


def _control_client(endpoint: RemoteEndpoint, timeout_s: float) -> redis.Redis | RedisCluster:
    p = endpoint.params
    common: dict[str, object] = {
        "username": p.username,
        "password": p.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": p.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if p.tls:
        common |= {
            "ssl": True,
            "ssl_cert_reqs": "required" if p.tls_verify else "none",
            "ssl_check_hostname": p.tls_verify,
            "ssl_ca_certs": p.tls_ca_file,
        }
    seed = endpoint.seed
    if endpoint.cluster:
        # Connects and reads the slot map now: the prober's thread pays for it.
        return RedisCluster(host=seed.host, port=seed.port, **common)  # type: ignore[arg-type]
    return redis.Redis(host=seed.host, port=seed.port, db=p.db, **common)  # type: ignore[arg-type]
