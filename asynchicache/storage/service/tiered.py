"""L3 + L4 behind one backend: the disk first, then the remote tier.

The cache service holds one `TieredBackend` per namespace, so the engine sees
a single storage tier and its protocol does not change:

* `exists` counts the chain's leading pages on disk, then continues the chain
  in the remote tier;
* `load` (and `get`) reads the disk part, then the rest from the remote tier
  into private memory, verifies it, and copies each page into its slot only
  while the job's deadline holds; it reports how many pages came from L4.
  Pages found only remotely are written to disk on the way up when admission
  allows (`promote_to_disk`), in the background, from those private copies;
* `put` copies the store's slots once, up front (the deadline checked before
  each page), and never reads the slots again: the disk write and the upload
  to the remote tier (`write_remote`, queued so stores do not wait on the
  network) both work from that copy. When the staging budget is spent (a
  slow or stuck Redis) the upload is skipped and counted (`uploads_shed`): a
  store never waits on L4, so loads from disk never wait behind L4 writes.

L4 never holds up L3: a slow Redis (replies late but within the breaker's
timeouts) degrades to misses. At most `remote_jobs` loads read from L4 at
once (a load past that serves what the disk has: `remote_reads_shed`), so
the service's other workers stay free for disk loads; `exists_by_tier` is for
callers off the service's loop (its loop asks `disk_exists` and hands the rest
to a thread, storage.service.server).

So once `load`/`put` returns, nothing of this backend touches the L2 pool.

A remote tier that is down (circuit breaker open) is skipped at once.

Both tiers report their changes into one `EventLog` (storage.events). Pins
live on disk (storage.disk.pins) and also spare their pages in a remote clear.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from asynchicache.common.deadline import Deadline
from asynchicache.common.disk_admission import DiskAdmission
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
)
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.events import EventLog
from asynchicache.storage.write_behind import StagedPages, WriteBehind, stage

if TYPE_CHECKING:  # redis-py loads only when a remote tier is configured
    from asynchicache.storage.remote.remote_backend import RedisBackend

log = logging.getLogger(__name__)

_COUNTERS = (
    "pages_from_remote",
    "remote_pages_late",  # fetched and verified, but the job's deadline had passed
    "uploads_shed",  # staging full (L4 slow or down): not uploaded
    "remote_reads_shed",  # `remote_jobs` loads were reading L4 already: the disk's part only
    "promotions_skipped",
)


@dataclass(frozen=True)
class TieredConfig:
    """How the disk and the remote tier cooperate."""

    write_remote: bool = True  # every page stored on disk is also uploaded to L4
    promote_to_disk: bool = True  # pages read only from L4 are written to disk too
    # The engine's L2 -> L3 admission (CacheConfig's fields of the same names), applied to
    # promotions: a load is one hit; its chain is at least `pages * page_tokens` long.
    disk_admit_hits: int = 0
    disk_admit_tokens: int = 0
    page_tokens: int = 16
    staging_bytes: int = 1 << 30  # private copies awaiting background writes, per direction
    close_timeout_s: float = 30.0
    remote_jobs: int = 2  # loads reading L4 at once (the service: half its workers)

    def __post_init__(self) -> None:
        if self.disk_admit_hits < 0 or self.disk_admit_tokens < 0 or self.page_tokens <= 0:
            raise ValueError("admission limits must be >= 0 and page_tokens positive")
        if self.staging_bytes <= 0 or self.remote_jobs <= 0:
            raise ValueError("staging_bytes and remote_jobs must be positive")

    def admits(self, pages: int) -> bool:
        """Whether a chain of `pages` pages read from L4 may be written to disk (one hit)."""
        rule = DiskAdmission(self.disk_admit_hits, self.disk_admit_tokens)
        return rule.admits(hits=1, tokens=pages * self.page_tokens)


@dataclass(frozen=True)
class RemoteTierConfig:
    """The cache service's L4 settings, shared by every namespace it serves."""

    url: str  # --remote-url: redis[s][+cluster]://[user:password@]host[:port][/db]
    ttl_s: int | None = None  # --remote-ttl-s; None: the server's maxmemory-policy evicts
    cluster: bool | None = None  # None: from the URL
    write_remote: bool = True
    promote_to_disk: bool = True
    disk_admit_hits: int = 0  # CacheConfig.disk_admit_hits
    disk_admit_tokens: int = 0  # CacheConfig.disk_admit_tokens

    def __post_init__(self) -> None:
        from asynchicache.storage.remote.topology import parse_remote_url

        parse_remote_url(self.url, self.cluster)  # a bad URL fails at start, naming the flag
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"--remote-ttl-s must be positive seconds, got {self.ttl_s}")


def open_tiered(
    disk: DiskConfig,
    remote: RemoteTierConfig | None,
    events: EventLog | None = None,
    remote_jobs: int = TieredConfig.remote_jobs,
) -> TieredBackend:
    """The service's backend for one namespace: its disk store, and L4 when configured
    (both sign and verify pages with the disk config's keys)."""
    events = events or EventLog()
    if remote is None:
        return TieredBackend(DiskBackend(disk, events))
    from asynchicache.storage.remote.remote_backend import RedisBackend
    from asynchicache.storage.remote.remote_config import RedisConfig

    redis_cfg = RedisConfig(
        remote.url,
        disk.namespace,
        disk.layout,
        ttl_s=remote.ttl_s,
        cluster=remote.cluster,
        keys=disk.keys,
    )
    tiered = TieredConfig(
        write_remote=remote.write_remote,
        promote_to_disk=remote.promote_to_disk,
        disk_admit_hits=remote.disk_admit_hits,
        disk_admit_tokens=remote.disk_admit_tokens,
        page_tokens=disk.layout.shape[2],  # [layers, 2, page_size, kv_heads, head_dim]
        remote_jobs=remote_jobs,
    )
    return TieredBackend(DiskBackend(disk, events), RedisBackend(redis_cfg, events), tiered)


@dataclass(frozen=True)
class TierContents:
    """A tier's pages: (hash, parent) on disk (exact at event `seq`), hashes in L4
    (None: no remote tier, or it did not answer)."""

    seq: int
    disk: list[tuple[bytes, bytes]]
    remote: list[bytes] | None


@dataclass(frozen=True)
class TieredRead:
    """A finished load: leading pages verified in L2, and how many of them came from L4."""

    pages_ok: int
    pages_from_remote: int = 0


class TieredBackend(StorageBackend):
    """StorageBackend composing `DiskBackend` (L3) and an optional `RedisBackend` (L4)."""

    def __init__(
        self,
        disk: DiskBackend,
        remote: RedisBackend | None = None,
        config: TieredConfig | None = None,
    ) -> None:
        self.disk = disk
        self.remote = remote
        self.config = config or TieredConfig()
        self.layout = disk.layout
        self.namespace = disk.namespace  # the service compares it on a heartbeat Register
        budget = self.config.staging_bytes
        self._uploads = WriteBehind("remote-upload", budget) if remote else None
        self._promotions = WriteBehind("disk-promotion", budget) if remote else None
        # In `extra`, from 0; the service's workers share this backend.
        self._counters = StatsCounter(BackendStats(extra=dict.fromkeys(_COUNTERS, 0.0)))
        self._count = self._counters.add
        self._remote_gate = threading.BoundedSemaphore(self.config.remote_jobs)

    # -- StorageBackend -------------------------------------------------

    def exists(self, hashes: Hashes) -> int:
        return sum(self.exists_by_tier(hashes))

    def exists_by_tier(self, hashes: Hashes) -> tuple[int, int]:
        """(leading pages on disk, the pages after those in the remote tier); asks Redis."""
        on_disk = self.disk.exists(hashes)
        return on_disk, self.remote_exists(hashes, on_disk)

    def disk_exists(self, hashes: Hashes) -> tuple[int, bool]:
        """(leading pages on disk, whether L4 may hold more): never waits on the network."""
        on_disk = self.disk.exists(hashes)
        return on_disk, on_disk < len(hashes) and self._remote_up()

    def remote_exists(self, hashes: Hashes, on_disk: int) -> int:
        """The pages after the first `on_disk` that L4 holds (0 when it is down)."""
        if on_disk >= len(hashes) or not self._remote_up():
            return 0
        assert self.remote is not None
        return self.remote.exists(hashes[on_disk:])

    def get(
        self, hashes: Hashes, slots: Slots, pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        return self.load(hashes, slots, pool, deadline).pages_ok

    def load(
        self, hashes: Hashes, slots: Slots, pool: np.ndarray, deadline: Deadline | None = None
    ) -> TieredRead:
        """Disk first, then L4 for the rest of the chain; see the module docstring."""
        on_disk = self.disk.get(hashes, slots, pool, deadline)
        if on_disk == len(hashes) or not self._remote_up():
            return TieredRead(on_disk)
        if not self._remote_gate.acquire(blocking=False):
            self._count(remote_reads_shed=1)
            return TieredRead(on_disk)
        assert self.remote is not None
        try:
            fetched = self.remote.fetch(hashes[on_disk:], deadline)
        finally:
            self._remote_gate.release()
        got = fetched.copy_to(pool, slots[on_disk:], deadline)
        if got:
            self._count(pages_from_remote=got)
        if len(fetched.refs) > got:
            self._count(remote_pages_late=len(fetched.refs) - got)
        self._promote(fetched, len(hashes))
        return TieredRead(on_disk + got, got)

    def put(
        self, pages: Sequence[PageRef], pool: np.ndarray, deadline: Deadline | None = None
    ) -> int:
        """Store pages from a private copy of their slots; how many the disk holds now."""
        staged = stage(pages, pool, deadline)  # the one read of the slots
        held: StagedPages | None = staged  # None once the L4 upload queue took it over
        try:
            stored = self.disk.put(staged.refs, staged.pool, deadline)
            if self.config.write_remote and staged.refs and self._remote_up():
                held = self._upload(staged)
        finally:
            if held is not None:
                held.release()
        return stored

    def delete(self, hashes: Sequence[bytes]) -> int:
        removed = self.disk.delete(hashes)
        if self.remote is not None:
            removed += self.remote.delete(hashes)
        return removed

    def clear(
        self,
        scope: ClearScope = ClearScope(),  # noqa: B008 (frozen)
        tiers: Sequence[Tier] = (Tier.DISK, Tier.REMOTE),
    ) -> dict[Tier, Cleared]:
        """The namespace's pages in `scope`, per tier: on disk, and in L4 (shared by all
        instances). Pinned pages stay in both unless the scope includes them."""
        done: dict[Tier, Cleared] = {}
        pinned = self.disk.pins.hashes()  # before the disk clear may drop the pins
        if Tier.DISK in tiers:
            done[Tier.DISK] = self.disk.clear(scope)
        if Tier.REMOTE in tiers and self.remote is not None:
            done[Tier.REMOTE] = self.remote.clear(scope, pinned)
        return done

    @property
    def events(self) -> EventLog:
        return self.disk.events

    def contents(self, tiers: Sequence[Tier]) -> TierContents:
        """What each tier holds now; `seq` is the event number the disk part is exact at."""
        if Tier.DISK in tiers:
            disk, seq = self.disk.contents(lambda: self.events.seq)
        else:
            disk, seq = [], self.events.seq
        remote = None
        if Tier.REMOTE in tiers and self.remote is not None:
            remote = self.remote.contents()
        return TierContents(seq, disk, remote)

    def stats(self) -> BackendStats:
        """The disk's stats, with the tiering counters in `extra`."""
        snap = self.disk.stats()
        snap.extra.update(self._counters.snapshot().extra)
        for wb in (self._uploads, self._promotions):
            if wb is not None:
                for name, value in wb.counters.items():
                    snap.extra[f"{wb.name}_{name}"] = float(value)
                snap.extra[f"{wb.name}_staged_bytes"] = float(wb.staged_bytes)
        return snap

    def remote_stats(self) -> BackendStats | None:
        return self.remote.stats() if self.remote is not None else None

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued uploads and promotions (tests, shutdown)."""
        return all(
            wb.drain(timeout_s) for wb in (self._uploads, self._promotions) if wb is not None
        )

    def close(self) -> None:
        for wb in (self._uploads, self._promotions):
            if wb is not None:
                wb.close(self.config.close_timeout_s)
        if self.remote is not None:
            self.remote.close()
        self.disk.close()

    # -- internals ----------------------------------------------------------

    def _remote_up(self) -> bool:
        return self.remote is not None and self.remote.available

    def _upload(self, staged: StagedPages) -> StagedPages | None:
        """Queue `staged` for L4 (None: taken over); when staging is full (L4 slow), skip it
        (the caller releases it): a store never waits on the network."""
        assert self.remote is not None and self._uploads is not None
        if self._uploads.submit(staged, self.remote.put):
            return None
        self._count(uploads_shed=1)
        return staged

    def _promote(self, fetched: StagedPages, chain_pages: int) -> None:
        """Write pages read from L4 to disk in the background (takes `fetched` over)."""
        assert self._promotions is not None
        admitted = self.config.promote_to_disk and self.config.admits(chain_pages)
        if fetched.refs and admitted and self._promotions.submit(fetched, self.disk.put):
            return
        if fetched.refs and admitted:
            self._count(promotions_skipped=1)
        fetched.release()
