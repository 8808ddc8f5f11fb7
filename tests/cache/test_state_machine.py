"""Hypothesis drives random operations on HiRadixCache against a reference model.

Every page written to L1 carries a signature derived from its token prefix, so
wherever the page travels (L1 -> L2 -> storage -> L2 -> L1) its bytes can be
checked. The model remembers every prefix ever inserted: the cache may forget
(evict), but must never claim a prefix it was not given, never lose a locked
one, and never serve a page with the wrong bytes. `check_integrity()` runs after
every step, and lock counts are checked exactly whenever the cache is idle.

The storage tier may run late (`MemoryStorage.expire` / `settle`): tickets time
out for the cache while their work goes on and touches the slots later, as a
frozen cache service would. A cache that reused such a slot would serve or
store the wrong bytes, which the byte checks catch. Loads may also be given up
(`give_up`), their fallback prefix then held like any locked match.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import xxhash
from cache_helpers import LAYOUT, NS, PAGE, MemoryStorage, host_gb, tokens_for
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from asynchicache.common.keys import chain_hashes
from asynchicache.hierarchy import HiRadixCache, LoadTicket, MatchHandle
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.hierarchy.pools import HostPool
from asynchicache.settings.config import CacheConfig, WritePolicy

DEVICE_PAGES = 10
HOST_SLOTS = 8
MIN_STEPS = 2000

# Few distinct pages so prompts share prefixes and hits are common.
page_ids = st.lists(st.integers(0, 2), min_size=1, max_size=5)


def signature(prefix: tuple[int, ...]) -> float:
    """The value every element of the page ending `prefix` holds (exact in float32)."""
    return float(xxhash.xxh32_intdigest(repr(prefix).encode()) % (1 << 20) + 1)


class CacheMachine(RuleBasedStateMachine):
    steps: list[int]  # set by the test: a shared step counter

    def __init__(self) -> None:
        super().__init__()
        self.cache: HiRadixCache | None = None
        self.pool: HostPool | None = None
        self.storage: MemoryStorage | None = None
        self._hashes: dict[tuple[int, ...], bytes] = {}  # model prefix -> its last page's hash
        self.model: set[tuple[int, ...]] = set()  # every page prefix ever inserted
        self.held: list[tuple[MatchHandle, tuple[int, ...], int]] = []  # handle, ids, pages
        self.private: list[int] = []
        self.loading: list[tuple[LoadTicket, tuple[int, ...]]] = []
        self.history: list[list[int]] = []  # inserted prompts, to revisit

    def pick(self, ids: list[int], recent: int | None) -> list[int]:
        """`ids`, or (when `recent` is set) a prompt inserted earlier: hits need repeats."""
        if recent is None or not self.history:
            return ids
        return self.history[-1 - recent % len(self.history)]

    def build(
        self, policy: WritePolicy, with_storage: bool, cap: float, expire_every: int | None
    ) -> None:
        cfg = CacheConfig(
            page_size=PAGE,
            device_cache_tokens=DEVICE_PAGES * PAGE,
            host_cache_gb=host_gb(HOST_SLOTS),
            write_policy=policy,
            write_through_threshold=2,
            disk_cache_dir=None,
            max_quarantine_fraction=cap,
        )
        self.pool = HostPool.create(LAYOUT, HOST_SLOTS) if with_storage else None
        self.storage = MemoryStorage(self.pool) if self.pool is not None else None
        if self.storage is not None:
            self.storage.expire_every = expire_every
        self.cache = HiRadixCache(
            cfg, LAYOUT, NS, torch.device("cpu"), self.storage, host_pool=self.pool, strict=True
        )

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()
        if self.pool is not None:
            self.pool.close()

    # -- helpers ------------------------------------------------------------------------------

    @property
    def c(self) -> HiRadixCache:
        assert self.cache is not None
        return self.cache

    def known_pages(self, ids: tuple[int, ...]) -> int:
        n = 0
        while n < len(ids) and ids[: n + 1] in self.model:
            n += 1
        return n

    def check_bytes(self, ids: tuple[int, ...], pages: list[int]) -> None:
        tensor = self.c.device_pool.tensor
        for j, p in enumerate(pages):
            want = signature(ids[: j + 1])
            got = tensor[p]
            assert got.eq(want).all(), f"L1 page {p} for prefix {ids[: j + 1]} has wrong bytes"

    # -- rules --------------------------------------------------------------------------------

    @rule(ids=page_ids, keep=st.booleans(), tail=st.integers(0, PAGE - 1))
    def insert(self, ids: list[int], keep: bool, tail: int) -> None:
        key = tuple(ids)
        tokens = tokens_for(ids) + [7] * tail
        match = self.c.match(tokens)
        self.c.lock(match.handle)
        self.check_bytes(key, match.device_pages)
        have = len(match.device_pages)
        new = self.c.allocate(len(ids) - have + (1 if tail else 0))
        if new is None:
            self.c.unlock(match.handle)
            return
        for j, p in enumerate(new[: len(ids) - have]):
            self.c.device_pool.tensor[p].fill_(signature(key[: have + j + 1]))
        result = self.c.insert(tokens, match.device_pages + new)
        self.c.unlock(match.handle)
        self.history = [*self.history[-15:], ids]
        self.model.update(key[: j + 1] for j in range(len(ids)))
        assert len(result.device_pages) == len(ids) + (1 if tail else 0)
        self.check_bytes(key, result.device_pages[: len(ids)])
        if tail:
            self.private.append(result.device_pages[-1])
        if keep:
            self.held.append((result.handle, key, len(ids)))
        else:
            self.c.unlock(result.handle)

    @rule(ids=page_ids, recent=st.none() | st.integers(0, 15), cap=st.none() | st.integers(0, 5))
    def match(self, ids: list[int], recent: int | None, cap: int | None) -> None:
        ids = self.pick(ids, recent)
        key = tuple(ids)
        m = self.c.match(tokens_for(ids), max_pages=cap)
        total = len(m.device_pages) + m.host_hit_pages + m.storage_hit_pages
        assert total <= self.known_pages(key), "the cache claims a prefix it was never given"
        if cap is not None:
            assert total <= cap
        self.check_bytes(key, m.device_pages)

    @rule(ids=page_ids)
    def lock_match(self, ids: list[int]) -> None:
        m = self.c.match(tokens_for(ids))
        self.c.lock(m.handle)
        self.held.append((m.handle, tuple(ids), len(m.device_pages) + m.host_hit_pages))

    @rule(i=st.integers(0, 15))
    def unlock(self, i: int) -> None:
        if self.held:
            handle, _, _ = self.held.pop(i % len(self.held))
            self.c.unlock(handle)

    @rule(ids=page_ids, recent=st.none() | st.integers(0, 15))
    def insert_concurrently(self, ids: list[int], recent: int | None) -> None:
        """Two requests computed the same prompt: the second one's pages are duplicates."""
        ids = self.pick(ids, recent)
        key, tokens = tuple(ids), tokens_for(ids)
        m = self.c.match(tokens)
        self.c.lock(m.handle)
        have = len(m.device_pages)
        a = self.c.allocate(len(ids) - have)
        b = self.c.allocate(len(ids) - have) if a is not None else None
        if a is None or b is None:
            self.c.free(a or [])
            self.c.unlock(m.handle)
            return
        for j in range(len(ids) - have):
            for pages in (a, b):
                self.c.device_pool.tensor[pages[j]].fill_(signature(key[: have + j + 1]))
        first = self.c.insert(tokens, m.device_pages + a)
        second = self.c.insert(tokens, m.device_pages + b)
        assert second.device_pages == first.device_pages
        self.check_bytes(key, second.device_pages)
        self.model.update(key[: j + 1] for j in range(len(ids)))
        self.history = [*self.history[-15:], ids]
        for handle in (m.handle, first.handle, second.handle):
            self.c.unlock(handle)

    @rule(ids=page_ids, recent=st.integers(0, 15), evict_device=st.integers(0, DEVICE_PAGES))
    def load(self, ids: list[int], recent: int, evict_device: int) -> None:
        ids = self.pick(ids, recent)
        # Evicting first pushes pages down to L2, so loads have work to do.
        self.c.transfer.flush()
        self._collect(self.c.poll())
        self.c.evict(evict_device)
        m = self.c.match(tokens_for(ids))
        ticket = self.c.load(m)
        if ticket is not None:
            self.loading.append((ticket, tuple(ids)))

    @rule(recent=st.integers(0, 15), drop_host=st.integers(0, 3))
    def round_trip(self, recent: int, drop_host: int) -> None:
        """Push everything unlocked out of L1 (some out of L2 too), then load a prompt back."""
        if not self.history:
            return
        for _ in range(2):  # the second poll completes stores started by the first
            self.c.transfer.flush()
            self._collect(self.c.poll())
        self.c.evict(DEVICE_PAGES)
        self.c.evict_host(drop_host)
        ids = self.pick([], recent)
        ticket = self.c.load(self.c.match(tokens_for(ids)))
        if ticket is not None:
            self.loading.append((ticket, tuple(ids)))

    @rule(hold=st.booleans())
    def hold_storage(self, hold: bool) -> None:
        """Storage tickets wait (a slow or frozen service) or complete at the next poll."""
        if self.storage is not None:
            self.storage.hold = hold

    @rule()
    def expire_storage(self) -> None:
        """Every storage ticket queued now times out for the cache; its work runs later."""
        if self.storage is not None:
            self.storage.expire()

    @rule()
    def settle_storage(self) -> None:
        """The late storage work touches its slots now; `Settled` follows at the next poll."""
        if self.storage is not None:
            self.storage.settle()

    @rule(recent=st.integers(0, 15))
    def late_load(self, recent: int) -> None:
        """A prompt only in storage is loaded and the read times out: it lands at a settle."""
        if self.storage is None or not self.history:
            return
        self.storage.hold = False
        self.c.evict(DEVICE_PAGES)  # write-back copies to L2 now (and stores what it admits)
        for _ in range(2):  # the second poll completes stores started by the first
            self.c.transfer.flush()
            self._collect(self.c.poll())
        self.c.clear()
        ids = self.pick([], recent)
        self.storage.hold = True
        ticket = self.c.load(self.c.match(tokens_for(ids)))
        if ticket is not None:
            self.loading.append((ticket, tuple(ids)))
        self.storage.expire()
        self.storage.hold = False

    @rule(recent=st.integers(0, 15), pages=st.integers(1, 4), clear=st.booleans())
    def prefetch(self, recent: int, pages: int, clear: bool) -> None:
        """An arrival prefetch: a prompt's storage pages read into L2 only
        (engine/scheduling/prefetch.py)."""
        if self.storage is None or not self.history:
            return
        if clear:
            self.c.clear()
        ids = self.pick([], recent)
        ticket = self.c.prefetch(tokens_for(ids), pages)
        if ticket is not None:
            assert ticket.pages_from_storage <= pages
            self.loading.append((ticket, tuple(ids)))

    @rule()
    def late_stores(self) -> None:
        """The stores the next poll starts time out; they read their slots later, at a settle."""
        if self.storage is None:
            return
        self.storage.hold = True
        self.c.transfer.flush()
        self._collect(self.c.poll())
        self.storage.expire()
        self.storage.hold = False

    @rule(i=st.integers(0, 15))
    def give_up(self, i: int) -> None:
        if not self.loading:
            return
        ticket, ids = self.loading.pop(i % len(self.loading))
        fallback = self.c.give_up(ticket)
        assert len(fallback.device_pages) <= self.known_pages(ids)
        self.check_bytes(ids, fallback.device_pages)
        self.held.append((fallback.handle, ids, len(fallback.device_pages)))

    @rule()
    def poll(self) -> None:
        # Copies finish on a worker thread; waiting for them first makes what this
        # poll completes (and so every later step) reproducible for shrinking.
        self.c.transfer.flush()
        self._collect(self.c.poll())

    @rule()
    def drain(self) -> None:
        every = None
        if self.storage is not None:
            every, self.storage.expire_every = self.storage.expire_every, None
            self.storage.hold = False
            self._collect(self.c.poll())  # tickets that expired time out now...
            self.storage.settle()  # ...and their late work ends: nothing stays quarantined
        self._collect(self.c.drain())
        assert not self.loading
        assert self.c.abandoned_loads == 0
        assert self.c.stats().quarantined_slots == 0
        self._check_exact_locks()
        if self.storage is not None:
            self.storage.expire_every = every

    def _collect(self, finished: list[LoadTicket]) -> None:
        for ticket in finished:
            ids = next((k for t, k in self.loading if t is ticket), None)
            assert ids is not None, "poll reported a load nobody waits for (given up?)"
            self.loading = [(t, k) for t, k in self.loading if t is not ticket]
            assert ticket.done and ticket.handle is not None
            assert len(ticket.device_pages) <= self.known_pages(ids)
            self.check_bytes(ids, ticket.device_pages)
            self.c.unlock(ticket.handle)

    @rule(n=st.integers(1, DEVICE_PAGES))
    def evict(self, n: int) -> None:
        freed = self.c.evict(n)
        assert freed >= 0

    @rule(n=st.integers(1, HOST_SLOTS))
    def evict_host(self, n: int) -> None:
        self.c.evict_host(n)

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if len(self.private) + n > 4:  # a running request's pages, not a leak that starves L1
            return
        pages = self.c.allocate(n)
        if pages is not None:
            assert len(pages) == n
            self.private += pages

    @rule(k=st.integers(1, 6))
    def free(self, k: int) -> None:
        pages, self.private = self.private[:k], self.private[k:]
        if pages:
            self.c.free(pages)

    @rule(gate=st.integers(0, 7))
    def clear(self, gate: int) -> None:
        if gate == 5:  # rare: it empties the cache
            self.c.clear()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        self.steps.append(1)
        self.c.check_integrity()
        for handle, ids, pages in self.held:
            seen = self.c.lookup(tokens_for(list(ids)))
            assert seen["device"] + seen["host"] >= pages * PAGE, "a locked prefix was evicted"
            assert self.c.tree.is_attached(handle.node)

    @invariant()
    def every_copy_holds_its_page(self) -> None:
        """Each valid L1 page and L2 slot of the tree, and each stored page, has its bytes."""
        if self.cache is None:
            return
        valid = (SlotState.READY, SlotState.STORING, SlotState.STORED, SlotState.STORE_QUARANTINED)
        host = self.c.host_pool.tensor if self.c.host_pool is not None else None
        for node in self.c.tree.iter_nodes():
            ids = tuple(t // 100 for n in self.c.tree.path(node) for t in n.tokens[::PAGE])
            start = node.start_page
            for j, p in enumerate(node.device or ()):
                want = signature(ids[: start + j + 1])
                assert self.c.device_pool.tensor[p].eq(want).all(), f"L1 page {p} of {node}"
            for j, slot in enumerate(node.host or ()):
                if host is not None and self.c.parts.host.state(slot) in valid:
                    want = signature(ids[: start + j + 1])
                    assert host[slot].eq(want).all(), f"L2 slot {slot} of {node} has wrong bytes"
        if self.storage is not None:
            for page_hash, raw in self.storage.pages.items():
                ids = self._prefix_of_hash(page_hash)
                got = np.frombuffer(raw, dtype=np.float32)
                assert (got == signature(ids)).all(), f"storage holds wrong bytes for {ids}"

    def _prefix_of_hash(self, page_hash: bytes) -> tuple[int, ...]:
        for ids in self.model:
            if ids not in self._hashes:
                self._hashes[ids] = chain_hashes(NS.digest(), tokens_for(list(ids)), PAGE)[-1]
        by_hash = {h: ids for ids, h in self._hashes.items()}
        return by_hash[page_hash]

    def _check_exact_locks(self) -> None:
        """Idle: each node's lock count is exactly the held handles at or below it."""
        expected: dict[int, int] = {}
        for handle, _, _ in self.held:
            for node in self.c.tree.path(handle.node):
                expected[id(node)] = expected.get(id(node), 0) + 1
        for node in self.c.tree.iter_nodes():
            assert node.lock_ref == expected.get(id(node), 0), f"lock count off at {node}"
            assert node.host_ref == 0, f"store hold left at {node}"


class AnyCacheMachine(CacheMachine):
    """Every configuration: write policy, with or without storage, quarantine cap."""

    @initialize(
        policy=st.sampled_from(list(WritePolicy)),
        with_storage=st.sampled_from([True, False]),
        cap=st.sampled_from([0.25, 1.0]),  # 1.0: storage never pauses for quarantine
        expire_every=st.sampled_from([None, 2, 3]),  # storage tickets that time out on their own
    )
    def start(
        self, policy: WritePolicy, with_storage: bool, cap: float, expire_every: int | None
    ) -> None:
        self.build(policy, with_storage, cap, expire_every)


class LateStorageMachine(CacheMachine):
    """Always a storage tier, and one whose tickets often time out while their work goes on."""

    @initialize(
        policy=st.sampled_from([WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK]),
        cap=st.sampled_from([1.0, 0.25]),
        expire_every=st.sampled_from([2, 3]),
    )
    def start(self, policy: WritePolicy, cap: float, expire_every: int) -> None:
        self.build(policy, True, cap, expire_every)


def run_machine(machine: type[CacheMachine]) -> int:
    steps: list[int] = []
    start = time.monotonic()
    run_state_machine_as_test(
        type(machine.__name__, (machine,), {"steps": steps}),
        settings=settings(
            max_examples=100,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            derandomize=True,
        ),
    )
    print(f"{machine.__name__}: {len(steps)} steps")
    assert time.monotonic() - start < 120
    return len(steps)


def test_cache_state_machine_with_integrity_after_every_step() -> None:
    steps = run_machine(AnyCacheMachine)
    assert steps >= MIN_STEPS, f"only {steps} steps ran"


def test_cache_state_machine_with_storage_work_that_runs_late() -> None:
    steps = run_machine(LateStorageMachine)
    assert steps >= MIN_STEPS, f"only {steps} steps ran"
