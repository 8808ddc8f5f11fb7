"""L4: pages as self-describing, checksummed values in Redis or Valkey (one node or a cluster).

    key    ackv:<16 hex of namespace and layout>:<32 hex of the page hash>
    value  the page header of `storage.header` (as in disk files) + the page's bytes
           (framed and verified by `storage.remote.value`)

Pages are read and written on plain RESP connections (`storage.remote.resp`) in
parallel: the pages of a call are grouped by the node owning their slot, cut
into pipelined batches of `batch_pages` GETs or SETs, and spread over
`io_threads` threads, each with its own connection. A GET's payload is
received into a private buffer (`fetch`), its header and checksum are verified,
and only then, if the job's deadline still holds, is it copied into its L2 slot
(`read`): a reply that arrives late can never land in a slot the engine has
reused. A SET is sent straight from the buffer it is given (the service gives
private copies, see `storage.service.tiered`). A value that fails verification is a
miss, is UNLINKed and is counted in `corrupt_detected`. Small commands
(EXISTS, EXPIRE, UNLINK, SCAN) and the cluster's slot map go through redis-py.

Faults: any transport error (refused, reset, timeout) trips a circuit breaker.
While it is open every call returns at once (0 pages; the other tiers or a
recompute serve the request), and a background prober reconnects with
exponential backoff. Socket timeouts are short, and every page read has a time
limit of its own (`page_timeout_s`, and the job's deadline), so at most the
calls already in flight wait, and only that long. A read stopped by its job's
deadline closes its connection (replies are left unread) but is no outage.
Eviction is Redis's: an optional TTL per value, or the server's
`maxmemory-policy` (e.g. allkeys-lru).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Set
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
from redis.exceptions import ResponseError

from asynchicache.common.deadline import Deadline
from asynchicache.common.tiers import Tier
from asynchicache.storage.base import (
    BackendStats,
    Cleared,
    ClearScope,
    Hashes,
    PageRef,
    Slots,
    StatsCounter,
    StorageBackend,
    check_pool,
    check_read,
)
from asynchicache.storage.events import EventLog
from asynchicache.storage.page_index import IndexedPage
from asynchicache.storage.page_keys import MacMismatch
from asynchicache.storage.remote.breaker import CircuitBreaker
from asynchicache.storage.remote.link import OUTAGE, RemoteLink
from asynchicache.storage.remote.pipeline import PageCall, PagePipeline, PageRead, PageStatus
from asynchicache.storage.remote.remote_admin import clear_prefix, list_pages
from asynchicache.storage.remote.remote_config import RedisConfig, remote_key_prefix
from asynchicache.storage.remote.resp import NodeAddress
from asynchicache.storage.remote.topology import (
    RedisTopology,
    RemoteEndpoint,
    admin_client,
)
from asynchicache.storage.remote.value import ValueFormat
from asynchicache.storage.write_behind import StagedPages

log = logging.getLogger(__name__)

_UNLINK_BATCH = 512


def _entry(page: PageRef) -> IndexedPage:
    return IndexedPage(page.page_hash, 0, page.parent, page.tokens)


class RedisBackend(StorageBackend):
    """StorageBackend over Redis/Valkey (see the module docstring)."""

    def __init__(self, config: RedisConfig, events: EventLog | None = None) -> None:
        self.config = config
        self._events = (events or EventLog()).index_listener(Tier.REMOTE)
        self.layout = config.layout
        self.page_bytes = config.layout.page_bytes
        self.prefix = remote_key_prefix(config.namespace, config.layout)
        keys = config.keys.for_namespace(config.namespace) if config.keys else None
        self._format = ValueFormat(config.namespace, config.layout, config.ttl_s, keys)
        self._endpoint = config.endpoint
        self._stats = StatsCounter()
        self._count = self._stats.add
        self._breaker = CircuitBreaker(config.retry_initial_s, config.retry_max_s)
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="redis-io")
        self._link = RemoteLink(
            self._endpoint,
            config.control_timeout_s,
            self._breaker,
            self._count,
            f"key prefix {self.prefix.decode()}",
        )
        self._pipeline = PagePipeline(self._link, self._format, config.page_timeout_s, self._count)

    # -- StorageBackend -------------------------------------------------

    def exists(self, hashes: Sequence[bytes]) -> int:
        flags = self._exists_flags([self.key(h) for h in hashes])
        return flags.index(False) if False in flags else len(flags)

    def get(
        self, hashes: Hashes, slots: Slots, pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Read pages into their slots; returns how many leading pages were verified."""
        return len(self.read(hashes, slots, pool, deadline))

    def read(
        self, hashes: Hashes, slots: Slots, pool: np.ndarray, deadline: Deadline | None = None
    ) -> list[tuple[int, ...]]:
        """`get` that also returns the token ids of each leading page copied (from headers).

        Pages are fetched into private memory and verified first; each is copied
        into its slot only if `deadline` still holds then.
        """
        check_read(hashes, slots, pool, self.page_bytes)
        fetched = self.fetch(hashes, deadline)
        try:
            copied = fetched.copy_to(pool, slots, deadline)
            return [r.tokens for r in fetched.refs[:copied]]
        finally:
            fetched.release()

    def fetch(self, hashes: Sequence[bytes], deadline: Deadline | None = None) -> StagedPages:
        """Read pages into a private buffer: `refs` are the leading verified pages (tokens
        from their headers, `slot` their row). The caller releases it."""
        staged = StagedPages.empty(len(hashes), self.page_bytes)
        topo = self._usable()
        if topo is None or not hashes:
            self._count(misses=len(hashes))
            return staged
        keys = [self.key(h) for h in hashes]
        call = PageCall(list(hashes), keys, list(range(len(hashes))), staged.pool, deadline)
        reads = self._fan_out(topo, call, self._pipeline.read_batch)
        ok = next((r.index for r in reads if r.status is not PageStatus.OK), len(reads))
        self._after_reads(reads, call.keys)
        self._count(
            hits=ok, misses=len(hashes) - ok, pages_read=ok, bytes_read=ok * self.page_bytes
        )
        staged.refs.extend(
            PageRef(hashes[i], reads[i].tokens, i, reads[i].parent) for i in range(ok)
        )
        return staged

    def put(
        self, pages: Sequence[PageRef], pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Write pages from `pool[page.slot]` (skipping those already stored); how many are."""
        check_pool(pool, self.page_bytes, [p.slot for p in pages])
        unique = list({p.page_hash: p for p in pages}.values())
        topo = self._usable()
        if topo is None or not unique:
            self._count(store_failures=len(unique))
            return 0
        keys = [self.key(p.page_hash) for p in unique]
        present = self._exists_flags(keys, touch=self.config.ttl_s is not None)
        if len(present) != len(keys):  # the tier went down while asking
            self._count(store_failures=len(unique))
            return 0
        todo = [i for i, here in enumerate(present) if not here]
        call = PageCall(
            [unique[i].page_hash for i in todo],
            [keys[i] for i in todo],
            [unique[i].slot for i in todo],
            pool,
            deadline,
        )
        todo_pages = [unique[i] for i in todo]
        writes = self._fan_out(
            topo, call, lambda c, n, idx: self._pipeline.write_batch(c, n, idx, todo_pages)
        )
        stored = {unique[i].page_hash for i, here in enumerate(present) if here}
        stored |= {unique[todo[w.index]].page_hash for w in writes if w.status is PageStatus.OK}
        written = sum(w.status is PageStatus.OK for w in writes)
        self._count(
            pages_written=written,
            bytes_written=written * self.page_bytes,
            store_failures=len(writes) - written,
        )
        self._events.stored([_entry(p) for p in unique if p.page_hash in stored])
        return sum(p.page_hash in stored for p in pages)

    def delete(self, hashes: Sequence[bytes]) -> int:
        removed = self._unlink([self.key(h) for h in hashes])
        self._events.removed(list(hashes))
        return removed

    def clear(
        self,
        scope: ClearScope = ClearScope(),  # noqa: B008 (frozen)
        pinned: Set[bytes] = frozenset(),
    ) -> Cleared:
        """UNLINK this namespace's values in `scope` (every node; SCAN, never KEYS), keeping
        `pinned` pages unless the scope includes them; see storage.remote.admin."""
        if self._usable() is None:
            return Cleared(error="remote tier unavailable")
        client = admin_client(self._endpoint)
        try:
            done = clear_prefix(client, self.prefix, scope, pinned, self._events.removed)
        except OUTAGE as exc:
            return Cleared(error=f"remote tier failed during the clear: {exc}")
        except ResponseError as exc:
            return Cleared(error=f"remote tier refused the clear: {exc}")
        finally:
            client.close()
        self._count(cleared=done.removed)
        return done

    def contents(self) -> list[bytes] | None:
        """Every page hash of this namespace in the remote tier (SCAN); None when down."""
        if self._usable() is None:
            return None
        client = admin_client(self._endpoint)
        try:
            return list_pages(client, self.prefix)
        except (*OUTAGE, ResponseError) as exc:
            log.warning("remote contents failed: %s", exc)
            return None
        finally:
            client.close()

    def stats(self) -> BackendStats:
        snap = self._stats.snapshot()
        snap.extra["available"] = float(self.available)
        snap.extra["breaker_trips"] = float(self._breaker.trips)
        snap.extra["probes_failed"] = float(self._breaker.probes_failed)
        snap.extra["retry_in_s"] = self._breaker.retry_in_s
        return snap

    def close(self) -> None:
        self._link.close()
        self._io.shutdown(wait=True)

    # -- extras -----------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether calls currently reach the server (False while the breaker is open)."""
        return self._breaker.up

    def wait_available(self, timeout_s: float) -> bool:
        return self._breaker.wait_up(timeout_s)

    def key(self, page_hash: bytes) -> bytes:
        return self.prefix + page_hash.hex().encode()

    def _page_of(self, key: bytes) -> bytes:
        return bytes.fromhex(key[len(self.prefix) :].decode())

    @property
    def endpoint(self) -> RemoteEndpoint:
        return self._endpoint

    def _after_reads(self, reads: list[PageRead], keys: list[bytes]) -> None:
        bad = [r for r in reads if r.status is PageStatus.CORRUPT]
        if not bad:
            return
        log.warning(
            "remote: %d pages failed verification (first: %s); deleting them",
            len(bad),
            bad[0].reason,
        )
        self._count(corrupt_detected=len(bad))
        forged = sum(isinstance(r.reason, MacMismatch) for r in bad)
        if forged:
            self._count(mac_failures=forged)
        self._unlink([keys[r.index] for r in bad])
        self._events.removed([self._page_of(keys[r.index]) for r in bad])

    # -- small commands (redis-py) -----------------------------------------

    def _exists_flags(self, keys: list[bytes], touch: bool = False) -> list[bool]:
        """Per key, whether it is stored ([] when the tier is down); `touch` renews TTLs."""
        topo = self._usable()
        if topo is None or not keys:
            return []
        ttl_s = self.config.ttl_s
        try:
            pipe = topo.client.pipeline(transaction=False)
            for k in keys:
                if touch and ttl_s is not None:
                    pipe.expire(k, ttl_s)  # 1 if it exists (and is renewed), else 0
                else:
                    pipe.exists(k)
            return [bool(x) for x in pipe.execute()]
        except OUTAGE as exc:
            self._outage(exc)
        except ResponseError as exc:
            self._count(server_errors=1)
            log.warning("remote EXISTS failed: %s", exc)
        return []

    def _unlink(self, keys: list[bytes]) -> int:
        topo = self._usable()
        if topo is None or not keys:
            return 0
        removed = 0
        try:
            for k in range(0, len(keys), _UNLINK_BATCH):
                pipe = topo.client.pipeline(transaction=False)
                for key in keys[k : k + _UNLINK_BATCH]:
                    pipe.unlink(key)
                removed += sum(int(x) for x in pipe.execute())
        except OUTAGE as exc:
            self._outage(exc)
        except ResponseError as exc:
            log.warning("remote UNLINK failed: %s", exc)
        return removed

    # -- fan-out, faults, probing --------------------------------------------

    def _fan_out(
        self,
        topo: RedisTopology,
        call: PageCall,
        batch_fn: Callable[[PageCall, NodeAddress, list[int]], list[PageRead]],
    ) -> list[PageRead]:
        """Run `batch_fn(call, node, indices)` per node and batch in parallel; results by index."""
        by_node: dict[NodeAddress, list[int]] = {}
        try:
            for i, key in enumerate(call.keys):
                by_node.setdefault(topo.node_of(key), []).append(i)
        except OUTAGE as exc:
            self._outage(exc)
            return [PageRead(i, PageStatus.FAILED) for i in range(len(call.keys))]
        step = self.config.batch_pages
        futures = [
            self._io.submit(batch_fn, call, node, idx[k : k + step])
            for node, idx in by_node.items()
            for k in range(0, len(idx), step)
        ]
        wait(futures)  # none still reads or writes `call.pool` when this returns or raises
        results = [r for f in futures for r in f.result()]
        return sorted(results, key=lambda r: r.index)

    def _usable(self) -> RedisTopology | None:
        return self._link.usable()

    def _outage(self, exc: BaseException) -> None:
        self._link.outage(exc)
