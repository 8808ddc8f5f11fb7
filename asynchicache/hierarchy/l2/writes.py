"""`Writer`: traffic down the tiers, L1 -> L2 copies and L2 -> storage stores.

An L1 -> L2 write locks the deepest node it copies (nothing it reads can be
evicted) and its slots are WRITING until the copy lands. A store only holds
the L2 copies it reads (`host_ref`), so a slow disk does not pin L1 pages; its
slots are STORING until the completion, and STORE_QUARANTINED (still held,
bytes unchanged) until `Settled` when the completion was a timeout the service
may outlive (the storage ticket's lifecycle is `SlotTickets`', slot_tickets.py, shared
with the vLLM connector). Past the quarantine cap no store starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from asynchicache.common.disk_admission import DiskAdmission
from asynchicache.hierarchy.eviction import Evictor
from asynchicache.hierarchy.l2.jobs import StoreJob, WriteJob
from asynchicache.hierarchy.l2.ledger import SlotState
from asynchicache.hierarchy.l2.slot_tickets import Unsettled
from asynchicache.hierarchy.l2.transfer import TransferDone
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.parts import CacheParts
from asynchicache.settings.config import WritePolicy
from asynchicache.storage.base import Completion, PageRef

log = logging.getLogger(__name__)


class Writer:
    """Starts and completes L1 -> L2 writes and L2 -> storage stores."""

    def __init__(self, parts: CacheParts, evictor: Evictor) -> None:
        self.parts = parts
        self.evictor = evictor

    # -- L1 -> L2 -----------------------------------------------------------------------------

    def on_hit(self, path: list[RadixNode], prompt_tokens: int) -> None:
        """Hit counts drive selective write-through and storage admission."""
        for node in path:
            node.hit_count += 1
        p = self.parts
        if p.host_pool is None:
            return
        cfg = p.config
        hot: list[RadixNode] = []
        due: list[RadixNode] = []
        if cfg.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            threshold = cfg.write_through_threshold
            hot = [
                n
                for n in path
                if n.device is not None and n.host is None and n.hit_count >= threshold
            ]
        if p.storage is not None and cfg.disk_admit_hits > 0:
            due = [n for n in path if n.host is not None and n.hit_count >= cfg.disk_admit_hits]
        if not hot and not due:
            return
        deepest = path[-1]
        p.tree.lock(deepest)  # the writes below may evict L2: keep this match's nodes
        try:
            if hot:
                self.write_nodes(hot, prompt_tokens)
            if due:
                self.store_nodes(due)
        finally:
            p.tree.unlock(deepest)

    def write_through(self, node: RadixNode, prompt_tokens: int) -> None:
        """Start the L1 -> L2 copies the write policy asks for at insert time."""
        cfg = self.parts.config
        if self.parts.host_pool is None or cfg.write_policy == WritePolicy.WRITE_BACK:
            return
        selective = cfg.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE
        threshold = cfg.write_through_threshold if selective else 0
        todo = [
            n
            for n in self.parts.tree.path(node)
            if n.device is not None and n.host is None and n.hit_count >= threshold
        ]
        if todo:
            self.write_nodes(todo, prompt_tokens)

    def claim(self, node: RadixNode, prompt_tokens: int) -> None:
        """A request that stores inserted the path to `node`: pages a `cache_store: false`
        request left there may be stored now (those already in L2 are, if admitted)."""
        claimed = [n for n in self.parts.tree.path(node) if n.no_store]
        if not claimed:
            return
        for n in claimed:
            n.no_store = False
        ready = [n for n in claimed if n.host is not None]
        if (
            ready
            and self.parts.storage is not None
            and self.admit(max(n.hit_count for n in ready), prompt_tokens)
        ):
            self.store_nodes(ready)

    def persist(self, path: list[RadixNode]) -> None:
        """Push a path's pages down to storage now, whatever the admission rules say (a
        pin): L1-only runs are written to L2 (then stored), valid L2 pages stored."""
        p = self.parts
        if not path or p.host_pool is None:
            return
        for node in path:
            node.no_store = False  # pinning is asking for it
        p.tree.lock(path[-1])
        try:
            l1_only = [n for n in path if n.host is None and n.device is not None]
            if l1_only:
                self.write_nodes(l1_only, 0, admit=True)
            in_l2 = [n for n in path if n.host is not None]
            if in_l2 and p.storage is not None:
                self.store_nodes(in_l2)
        finally:
            p.tree.unlock(path[-1])

    def write_nodes(
        self, nodes: list[RadixNode], prompt_tokens: int, admit: bool | None = None
    ) -> None:
        """Copy the L1 pages of `nodes` (all on one path, prefix first) to fresh L2 slots;
        `admit` overrides the L2 -> storage admission rules."""
        p = self.parts
        assert p.host_pool is not None and p.host_pool.tensor is not None
        n = sum(node.num_pages for node in nodes)
        slots = self.evictor.alloc_host(n, SlotState.WRITING)
        if slots is None:
            p.counters.writes_skipped += n
            self.start_waiting_stores(idle=False, now=True)  # their holds free L2 soon
            return
        src: list[int] = []
        i = 0
        for node in nodes:
            node.host = slots[i : i + node.num_pages]
            src += node.device or []
            i += node.num_pages
        deepest = nodes[-1]
        p.tree.lock(deepest)
        if admit is None:
            admit = self.admit(max(nd.hit_count for nd in nodes), prompt_tokens)
        ticket = p.transfer.submit(p.device_pool.tensor, src, p.host_pool.tensor, slots)
        p.transfers[ticket] = WriteJob(deepest, slots, admit)

    def backup(self, node: RadixNode) -> None:
        """Write-back: copy an evicted L1 run to L2 now (the eviction needs the page back)."""
        p = self.parts
        assert p.host_pool is not None and p.host_pool.tensor is not None
        slots = self.evictor.alloc_host(node.num_pages, SlotState.WRITING)
        if slots is None:
            p.counters.writes_skipped += node.num_pages
            self.start_waiting_stores(idle=False, now=True)  # their holds free L2 soon
            return
        ticket = p.transfer.submit(
            p.device_pool.tensor, node.device or [], p.host_pool.tensor, slots
        )
        done = p.transfer.wait(ticket)
        if not done.ok:
            p.counters.transfer_failures += 1
            p.host.move(slots, SlotState.WRITING, SlotState.FREE)
            return
        node.host = slots
        p.host.move(slots, SlotState.WRITING, SlotState.READY)
        p.counters.device_to_host_pages += done.num_pages
        p.counters.device_to_host_bytes += done.num_bytes
        if self.admit(node.hit_count, node.end_page * p.layout.page_size):
            self.store_nodes([node])

    def admit(self, hits: int, prompt_tokens: int) -> bool:
        """L2 -> storage admission: hot pages or long prompts (both limits 0: everything)."""
        if self.parts.storage is None:
            return False
        cfg = self.parts.config
        return DiskAdmission(cfg.disk_admit_hits, cfg.disk_admit_tokens).admits(hits, prompt_tokens)

    def on_write(self, job: WriteJob, done: TransferDone) -> None:
        p = self.parts
        try:
            if not done.ok:
                p.counters.transfer_failures += 1
                self._drop_copies(job)
                return
            p.host.move(job.slots, SlotState.WRITING, SlotState.READY)
            p.latency.observe("store", "host", time.monotonic() - job.started)
            p.counters.device_to_host_pages += done.num_pages
            p.counters.device_to_host_bytes += done.num_bytes
            nodes = self._nodes_holding(job.deepest, job.slots)
            if any(n.hashes[0] in p.pins for n in nodes):  # pins go to disk, at once
                self.store_nodes(nodes)
            elif job.admit and nodes:  # new pages: when the engine is quiet (store_queue.py)
                p.tree.hold_host(job.deepest)
                p.store_queue.add(job.deepest, tuple(job.slots))
        finally:
            p.tree.unlock(job.deepest)

    def start_waiting_stores(self, idle: bool, now: bool = False) -> None:
        """Start the queued stores that are due (`now`: all of them); `idle`: no work."""
        p = self.parts
        queue = p.store_queue
        for waiting in queue.take_all() if now else queue.due(idle, p.host.size):
            try:
                nodes = self._nodes_holding(waiting.deepest, waiting.slots)
                if nodes and p.storage is not None:
                    self.store_nodes(nodes)
            finally:
                p.tree.release_host(waiting.deepest)

    def _drop_copies(self, job: WriteJob) -> None:
        """Forget the L2 copies a write was making (their L1 pages stay)."""
        writing = [s for s in job.slots if self.parts.host.state(s) == SlotState.WRITING]
        for node in self._nodes_holding(job.deepest, writing):
            node.host = None
        self.parts.host.move(writing, SlotState.WRITING, SlotState.FREE)

    def _nodes_holding(self, deepest: RadixNode, slots: Sequence[int]) -> list[RadixNode]:
        """Nodes on the path to `deepest` whose L2 slots are among `slots`."""
        wanted = set(slots)
        return [
            n for n in self.parts.tree.path(deepest) if n.host is not None and n.host[0] in wanted
        ]

    # -- L2 -> storage ------------------------------------------------------------------------

    def store_nodes(self, nodes: list[RadixNode]) -> None:
        """Persist the valid, not yet stored L2 pages of `nodes` (one path) below L2."""
        p = self.parts
        assert p.storage is not None
        ps, refs = p.layout.page_size, []
        nodes = [n for n in nodes if not n.no_store]  # cache_store: false keeps them in L1/L2
        for node in nodes:
            assert node.parent is not None  # a stored node is never the root
            parents = [p.tree.last_hash(node.parent), *node.hashes[:-1]]
            for j, s in enumerate(node.host or ()):
                if p.host.state(s) == SlotState.READY:
                    page_tokens = tuple(node.tokens[j * ps : (j + 1) * ps])
                    refs.append(PageRef(node.hashes[j], page_tokens, s, parents[j]))
        if not refs:
            return
        if p.storage_paused:
            p.counters.storage_stores_paused += len(refs)
            return
        slots = [r.slot for r in refs]
        p.host.move(slots, SlotState.READY, SlotState.STORING)
        deepest = nodes[-1]
        p.tree.hold_host(deepest)
        try:
            ticket = p.storage.submit_store(refs)
        except Exception:
            log.exception("storage.submit_store failed")
            p.counters.store_failures += 1
            p.host.move(slots, SlotState.STORING, SlotState.READY)
            p.tree.release_host(deepest)
            return
        p.tickets.add(ticket, StoreJob(deepest, slots))

    def on_store(self, job: StoreJob, c: Completion) -> None:
        p = self.parts
        end = p.tickets.store_done(c, job.slots, hold=job.deepest)
        if end.quarantined:
            # The service may still read these slots: keep them held and unchanged.
            p.host.move(job.slots, SlotState.STORING, SlotState.STORE_QUARANTINED)
            p.counters.slots_quarantined += len(job.slots)
            p.counters.tickets_late += 1
            p.counters.store_failures += 1
            log.warning("store of %d pages timed out (%s); slots held until settled",
                        len(job.slots), c.error)  # fmt: skip
            return
        stored = end.stored
        if stored:
            p.latency.observe("store", "disk", time.monotonic() - job.started)
        try:
            if not stored:
                p.counters.store_failures += 1
                log.warning("store of %d pages: %d persisted (%s)", len(job.slots), c.pages_ok,
                            c.error)  # fmt: skip
            state = SlotState.STORED if stored else SlotState.READY
            p.host.move(job.slots, SlotState.STORING, state)
            p.counters.host_to_storage_pages += c.pages_ok
            p.counters.host_to_storage_bytes += c.pages_ok * p.layout.page_bytes
        finally:
            p.tree.release_host(job.deepest)

    def settle_store(self, record: Unsettled[RadixNode]) -> None:
        """A timed-out store settled: its slots are the cache's again (not known stored)."""
        p = self.parts
        p.host.move(record.slots, SlotState.STORE_QUARANTINED, SlotState.READY)
        if record.hold is not None:
            p.tree.release_host(record.hold)

    def fail(self, job: WriteJob | StoreJob) -> None:
        """A completion handler raised: leave the job's slots in a state nothing waits on."""
        if isinstance(job, WriteJob):
            self._drop_copies(job)
            return
        storing = [s for s in job.slots if self.parts.host.state(s) == SlotState.STORING]
        self.parts.host.move(storing, SlotState.STORING, SlotState.READY)
