"""The L2 ticket lifecycle exists once (issue 43): one test, both users of it.

`SlotTickets` (hierarchy/l2/slot_tickets.py) books the storage tickets over L2 slots of
our hierarchy (`HiRadixCache`) and of the vLLM connector (`HostTier`). Each is driven
here through the same story over a real cache service process and real disk files:
pages saved to disk and dropped from L2; a load of them started while the service is
frozen (SIGSTOP), and given up by its requester at once; the service wakes up and reads
(or skips) it late. Until the service's `Settled`, the load's slots are quarantined in
the user's `SlotTickets` (held, never served, never reused); then they are free again,
and nothing of the given-up load was served.

(Here because `HostTier` counts into vLLM's connector stats: the vLLM venv runs it.)
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from service_process import ServiceProcess
from settling import wait_until

from asynchicache.common.keys import Namespace
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.hierarchy.l2.slot_tickets import SlotTickets
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.hierarchy.results import MatchResult
from asynchicache.integrations.vllm.block_lookup import RequestChain
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.connector_jobs import Job, JobKind
from asynchicache.integrations.vllm.connector_stats import AsynchicacheStats
from asynchicache.integrations.vllm.l2.host_tier import HostTier, Prefetched
from asynchicache.integrations.vllm.l2.service_link import ExistsAnswer
from asynchicache.integrations.vllm.l2.service_process import service_pid, wait_service_gone
from asynchicache.integrations.vllm.metadata import AsynchicacheWorkerMeta
from asynchicache.integrations.vllm.namespace import ModelIdentity
from asynchicache.integrations.vllm.spec import VllmKVSpec
from asynchicache.settings.config import CacheConfig
from asynchicache.storage.base import PageLayout, PageRef, TicketKind
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient

PAGE = 16
PAGES = 3
TOKENS = list(range(1000, 1000 + PAGES * PAGE))


class L2User(Protocol):
    """What the test does to a user of the L2 lifecycle, in that user's own terms."""

    tickets: SlotTickets[Any, Any]

    def save(self) -> None:
        """TOKENS' pages stored on disk by the service, and no longer in L1 or L2."""

    def below_l2(self) -> int:
        """Pages of TOKENS the service holds (asked with the service running)."""

    def start_load(self) -> None:
        """Read them from storage into L2 slots (the service may be frozen)."""

    def give_up(self) -> None:
        """The requester waits no more (as the engine's prefetch timeout or the
        connector's `prefetch_timeout_s` would)."""

    def poll(self) -> None:
        """Collect what finished; a given-up load is never reported as served."""

    def free_slots(self) -> int: ...

    def served(self) -> int:
        """Pages of TOKENS a request would now find above storage (L1 or L2)."""

    def check(self) -> None: ...

    def service(self) -> int:
        """The cache service's pid."""

    def close(self) -> None: ...


class Hierarchy:
    """Our engine's cache with a real `StorageClient` to a service process."""

    LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32)
    NS = Namespace("l2-lifecycle-test", "float32", PAGE)

    def __init__(self, tmp_path: Path) -> None:
        self.sock_dir = Path(tempfile.mkdtemp(prefix="acl2-"))  # ipc paths must stay short
        address = f"ipc://{self.sock_dir}/svc.sock"
        self.proc = ServiceProcess(tmp_path / "kv", address).start()
        self.pool = HostPool.create(self.LAYOUT, 8)
        page = PageLayout("float32", self.LAYOUT.page_shape)
        # Lookups may wait (a test on a busy host), unlike an engine's step.
        client = ClientConfig(address, self.NS.encode(), self.pool.name, page, exists_timeout_s=5)
        self.client = StorageClient(client)
        cfg = CacheConfig(
            page_size=PAGE,
            device_cache_tokens=8 * PAGE,
            host_cache_gb=8 * self.LAYOUT.page_bytes / 2**30,
            disk_cache_dir=tmp_path / "kv",
        )
        self.cache = HiRadixCache(
            cfg, self.LAYOUT, self.NS, torch.device("cpu"), self.client, host_pool=self.pool
        )
        self.tickets = self.cache.parts.tickets
        assert self.client.wait_ready(60), "no cache service"
        self.match: MatchResult | None = None

    def save(self) -> None:
        pages = self.cache.allocate(PAGES)
        assert pages is not None
        for i, p in enumerate(pages):
            self.cache.device_pool.tensor[p].fill_(10.0 + i)
        self.cache.unlock(self.cache.insert(TOKENS, pages).handle)
        self.cache.drain(timeout_s=60)
        assert self.cache.stats().counters.host_to_storage_pages == PAGES
        self.cache.clear()  # nothing left in L1 or L2

    def below_l2(self) -> int:
        self.match = self.cache.match(TOKENS)
        return self.match.storage_hit_pages

    def start_load(self) -> None:
        assert self.match is not None
        self.ticket = self.cache.load(self.match)
        assert self.ticket is not None

    def give_up(self) -> None:
        fallback = self.cache.give_up(self.ticket)
        assert fallback.device_pages == []
        self.cache.unlock(fallback.handle)

    def poll(self) -> None:
        assert self.cache.poll() == [], "a given-up load was reported"

    def free_slots(self) -> int:
        host = self.cache.stats().host
        assert host is not None
        return host.free

    def served(self) -> int:  # from the tree alone: a lookup would ask the frozen service
        nodes = [n for n in self.cache.tree.iter_nodes() if not n.is_root]
        return sum(n.num_pages for n in nodes if n.device is not None or n.host is not None)

    def check(self) -> None:
        self.cache.check_integrity()
        counters = self.cache.stats().counters
        assert counters.tickets_late == 0, "a cancelled load was counted late"

    def service(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        self.cache.close()
        self.client.close()
        self.pool.close()
        self.proc.stop()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


class Connector:
    """The vLLM connector's `HostTier` (its L2 segment, index and service link), driven
    as its scheduler side drives it (scheduler_side.py), without vLLM's scheduler."""

    BLOCK = 32

    def __init__(self, tmp_path: Path) -> None:
        identity = ModelIdentity(
            "tiny-test", "0" * 40, "test", "cpu", "CPU_ATTN:vec", "float32", self.BLOCK
        )
        spec = VllmKVSpec(self.BLOCK, 64, ("l0", "l1"), 2, 8, torch.float32, identity)
        self.config = ConnectorConfig(
            disk_cache_dir=tmp_path / "kv",
            cache_service=f"ipc://{tmp_path}/run/c.sock",
            host_cache_gb=100_000 / 2**30,
            page_size=PAGE,
            service_start_timeout_s=60.0,
        )
        namespace = spec.namespace(PAGE)
        self.stats = AsynchicacheStats()
        self.host = HostTier(
            spec, self.config, namespace.encode(), self.stats, False, lambda _: (None, None)
        )
        self.tickets = self.host.tickets
        assert self.host.link.wait_connected(60), "no cache service"
        self.chain = RequestChain(namespace.digest(), PAGE)
        self.hashes = self.chain.extend(TOKENS)
        self.job = 0

    def _refs(self, slots: list[int]) -> list[PageRef]:
        return [
            PageRef(
                self.hashes[p], tuple(TOKENS[p * PAGE : (p + 1) * PAGE]), s, self.chain.parent(p)
            )
            for p, s in enumerate(slots)
        ]

    def save(self) -> None:
        index, pool = self.host.index, self.host.pool.tensor
        assert pool is not None
        slots = index.allocate(PAGES)
        assert slots is not None
        pool[slots] = torch.randn(PAGES, *pool.shape[1:])  # as the worker's save copy
        job = self.host.register(Job(JobKind.SAVE_COPY, "saver", slots, self._refs(slots)))
        self.host.worker_reports(AsynchicacheWorkerMeta(saves_done=[job]))  # -> the service

        def stored() -> bool:
            self.host.poll()
            return self.stats.data.get("pages_stored", 0) >= PAGES

        wait_until(stored, "the saved pages stored", timeout_s=60, every_s=0.02)
        every = index.allocate(index.num_slots)  # evicts them from L2
        assert every is not None
        index.release(every)
        assert index.leading(self.hashes) == []

    def below_l2(self) -> int:
        answers: list[int] = []

        def answered() -> bool:
            self.host.link.ask_exists(7, self.hashes)
            self.host.link.wait_events(1.0)
            answers.extend(e.pages for e in self.host.poll() if isinstance(e, ExistsAnswer))
            return bool(answers) and answers[-1] == PAGES

        wait_until(answered, "the service to find the pages", timeout_s=30, every_s=0.05)
        return answers[-1]

    def start_load(self) -> None:  # as SchedulerSide._read
        slots = self.host.index.allocate(PAGES, SlotState.LOADING)
        assert slots is not None
        refs = self._refs(slots)
        self.job = self.host.register(Job(JobKind.PREFETCH, "reader", slots, refs, 7))
        self.host.link.load(self.job, self.hashes, slots)

    def give_up(self) -> None:
        self.host.give_up(self.job)

    def poll(self) -> None:
        for got in self.host.poll():
            assert not (isinstance(got, Prefetched) and got.ready), "a given-up load served"

    def free_slots(self) -> int:
        return self.host.index.counts()["free"]

    def served(self) -> int:
        return len(self.host.index.leading(self.hashes))

    def check(self) -> None:
        self.host.check_integrity()

    def service(self) -> int:
        pid = service_pid(self.config.service_address)
        assert pid is not None
        return pid

    def close(self) -> None:
        self.host.close()
        assert wait_service_gone(self.config.service_address, 30)


@pytest.fixture(params=[Hierarchy, Connector], ids=["hierarchy", "connector"])
def user(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[L2User]:
    made = request.param(tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_a_given_up_load_landing_late_stays_quarantined_until_settled(user: L2User) -> None:
    user.save()
    assert user.below_l2() == PAGES and user.served() == 0
    free = user.free_slots()
    pid = user.service()
    os.kill(pid, signal.SIGSTOP)  # it gets the load only after the requester gave up
    try:
        user.start_load()
        user.give_up()  # the client gives the ticket up at once: unsettled, cancelled

        def quarantined() -> bool:
            user.poll()
            return bool(user.tickets.unsettled)

        wait_until(quarantined, "the given-up load's completion", timeout_s=10, every_s=0.01)
        [record] = user.tickets.unsettled.values()
        assert record.kind is TicketKind.LOAD and len(record.slots) == PAGES
        assert not user.tickets.open
        assert user.free_slots() == free - PAGES  # held while the service may write them
        user.poll()
        assert user.tickets.quarantined() == record.slots and user.served() == 0
        user.check()
    finally:
        os.kill(pid, signal.SIGCONT)

    # The service reads (or skips) the load now, late; its reply settles the ticket.
    def settled() -> bool:
        user.poll()
        return not user.tickets.unsettled

    wait_until(settled, "the late load settled", timeout_s=30, every_s=0.01)
    assert user.free_slots() == free, "the given-up load's slots were not freed"
    assert user.served() == 0, "pages of a given-up, unsettled load were served"
    user.check()
