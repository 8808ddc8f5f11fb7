"""KV events from a real cache service process: a subscriber that applies them holds what the
service holds (its contents reply and its stats agree), a late subscriber catches up from
the contents reply, and lost events are detected."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pools import NAMESPACE, SMALL, Pool, chain, new_hashes
from storage_clients import Clients

from asynchicache.common.keys import Namespace
from asynchicache.common.tiers import AllBlocksCleared, BlockRemoved, BlockStored, TierEvent
from asynchicache.settings.config import GIB
from asynchicache.storage.admin_messages import StorageEvents
from asynchicache.storage.base import PageRef
from asynchicache.storage.client.event_feed import EventFeed
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.disk.disk_backend import DiskConfig
from asynchicache.storage.events import EventLog

FILE = DiskConfig(Path("/unused"), NAMESPACE, SMALL, 1).page_file_bytes
PAGE = SMALL.shape[2]
NS = Namespace("m", "float32", PAGE)


class Mirror:
    """A subscriber's view: the set of pages per tier, rebuilt from events only."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {"disk": set(), "remote": set()}
        self.applied = 0

    def apply(self, event: TierEvent) -> None:
        self.applied += 1
        if isinstance(event, BlockStored):
            self.tiers[event.tier] |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.tiers[event.tier] -= set(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.tiers[event.tier].clear()


@pytest.fixture
def clients(clients: Clients) -> Clients:
    """Clients that are connected (and subscribed to events) when returned."""
    return functools.partial(clients, ready_s=30, events=True)


def follow(client: StorageClient, mirror: Mirror, after: int = 0) -> int:
    """Apply every event that came (numbered after `after`) until the service is quiet:
    the last number applied equals the number its contents reply is exact at."""
    deadline = time.monotonic() + 30
    last = after
    while time.monotonic() < deadline:
        client.poll()
        batch = client.take_events()
        assert not batch.gap
        for number, event in batch.events:
            if number > after:
                mirror.apply(event)
                last = number
        reply = client.contents(("disk",))
        assert reply is not None
        if reply.seq == last:
            return last
        time.sleep(0.05)
    raise AssertionError("the events never caught up with the service")


def run(client: StorageClient, refs: list[PageRef]) -> None:
    ticket = client.submit_store(refs)
    [done] = client.wait([ticket], 30)
    assert done.pages_ok == len(refs), done


def test_a_subscriber_rebuilds_what_the_service_holds(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    services(tmp_path / "kv", addr, "--disk-cache-gb", str(40 * FILE / GIB))
    pool = make_pool(64, fill=64)
    client = clients(addr, pool)
    mirror = Mirror()
    salt = NS.with_salt("tenant").digest()
    for k in range(6):  # stores past the capacity: evictions
        run(client, chain(NS.digest(), 100 * k, 10))
    run(client, chain(salt, 0, 8, 10))
    ticket = client.submit_load([p.page_hash for p in chain(NS.digest(), 500, 10)], list(range(10)))
    client.wait([ticket], 30)  # a hit: nothing changes
    cleared = client.clear(("disk",), root=salt)  # one tenant's pages
    assert cleared is not None and cleared.removed == 8
    follow(client, mirror)
    contents = client.contents(("disk",))
    stats = client.stats()
    assert contents is not None and stats is not None and stats.disk is not None
    assert mirror.tiers["disk"] == set(contents.disk_hashes)
    assert len(mirror.tiers["disk"]) == stats.disk.pages > 0
    assert stats.disk.evictions > 0 and mirror.applied > 8
    everything = client.clear(("disk",))
    assert everything is not None and everything.removed == stats.disk.pages
    follow(client, mirror, contents.seq)
    assert mirror.tiers["disk"] == set()


def test_a_late_subscriber_catches_up_from_the_contents_reply(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    services(tmp_path / "kv", addr)
    early_pool, late_pool = make_pool(32), make_pool(32)
    early_pool.fill(range(32))
    early = clients(addr, early_pool, events=False)
    run(early, chain(NS.digest(), 0, 12))
    late = clients(addr, late_pool)
    replay = late.contents(("disk",))
    assert replay is not None and len(replay.disk_hashes) == 12
    parents = dict(zip(replay.disk_hashes, replay.disk_parents, strict=True))
    first = chain(NS.digest(), 0, 12)
    assert parents[first[5].page_hash] == first[4].page_hash  # the chains, not just pages
    mirror = Mirror()
    mirror.tiers["disk"] = set(replay.disk_hashes)
    run(early, chain(NS.digest(), 1000, 5, 12))  # stored after the replay
    follow(late, mirror, replay.seq)
    final = late.contents(("disk",))
    assert final is not None and mirror.tiers["disk"] == set(final.disk_hashes)
    assert len(final.disk_hashes) == 17


def test_a_restarted_service_is_a_gap(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    addr = f"ipc://{sock_dir}/svc.sock"
    first = services(tmp_path / "kv", addr)
    pool = make_pool(16, fill=16)
    client = clients(addr, pool)
    run(client, chain(NS.digest(), 0, 4))
    assert first.stop() == 0
    services(tmp_path / "kv", addr)
    assert client.wait_ready(30)
    batch = client.take_events()
    assert batch.gap and batch.events == []  # the old stream's events are superseded


def test_numbers_that_jump_are_a_gap() -> None:
    feed = EventFeed()
    removed = BlockRemoved("disk", (b"x" * 16,))
    feed.received(StorageEvents(0, 1, (removed,)))  # before subscribing: ignored
    feed.subscribed(pid=7, events_from=3)
    feed.received(StorageEvents(0, 2, (removed, removed, removed)))  # 2, 3 are old news
    feed.received(StorageEvents(0, 7, (removed,)))  # 5 and 6 never came
    batch = feed.take()
    assert [n for n, _ in batch.events] == [4, 7] and batch.gap and feed.lost == 2
    feed.received(StorageEvents(0, 8, (removed,)))
    assert not feed.take().gap
    feed.subscribed(pid=7, events_from=3)  # a heartbeat: same subscription
    assert not feed.take().gap


def test_an_overflowing_log_drops_the_oldest_and_the_subscriber_sees_it() -> None:
    log = EventLog(max_pending=2)
    log.emit(AllBlocksCleared("disk"))  # before anyone subscribed: numbered, not kept
    log.enable(lambda: None)
    feed = EventFeed()
    feed.subscribed(pid=1, events_from=log.seq)
    for h in new_hashes(3):
        log.emit(BlockRemoved("disk", (h,)))
    numbered = log.drain()
    assert [n for n, _ in numbered] == [3, 4] and log.dropped == 1
    feed.received(StorageEvents(0, numbered[0][0], tuple(e for _, e in numbered)))
    assert feed.take().gap and feed.lost == 1
