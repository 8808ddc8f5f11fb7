"""Records of the cache's asynchronous work while it is in flight.

Each copy or storage ticket maps to one job; its completion is handed to the
job's owner (`Writer` for `WriteJob` and `StoreJob`, `PageLoads` for `LoadJob`).
Storage tickets are booked in `CacheParts.tickets` (slot_tickets.py, the L2 ticket
lifecycle our hierarchy shares with the vLLM connector), copy tickets in
`CacheParts.transfers`. A load's progress is an explicit phase, not a chain of callbacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.results import MatchHandle


@dataclass(eq=False)
class LoadTicket:
    """An L2/L3 -> L1 load. `poll()` returns it once `done`.

    When done, `device_pages` is the whole L1 prefix now available (what was
    already on L1 plus what arrived) and `handle` holds one lock on it for the
    caller, who must `unlock` it. `ok` is False when fewer pages than asked for
    arrived; `error` says why, and the rest must be recomputed. `id` names the
    ticket for its whole life (never reused by another load of this cache).
    """

    id: int
    pages_from_host: int
    pages_from_storage: int
    pages_from_remote: int = 0  # of the storage pages that arrived, those read from L4
    done: bool = False
    ok: bool = False
    device_pages: list[int] = field(default_factory=list)
    handle: MatchHandle | None = None
    error: str | None = None
    elapsed_s: float = 0.0  # submit to completion, for the scheduler's bandwidth estimate


class LoadPhase(Enum):
    """Where a load is. READING and FILLING each have exactly one ticket in flight (`op`)."""

    READING = auto()  # storage -> L2 read in flight
    FILLING = auto()  # L2 -> L1 copy in flight
    DONE = auto()  # finished; waiting to be collected by `poll()` (or given up)


@dataclass(eq=False)
class LoadJob:
    """One load in flight, owned by `PageLoads`.

    Locks: the job locks `anchor` (and the node its storage pages land in)
    until DONE, so nothing it reads or fills can be evicted. `fallback`, the
    deepest L1 node of the match, is locked from submit until the ticket is
    collected or given up: whoever gives the load up takes that lock, so the
    prefix to fall back on cannot be evicted while the load runs.
    """

    ticket: LoadTicket
    anchor: RadixNode
    fallback: RadixNode
    expected_pages: int
    tokens: list[int]
    final: RadixNode  # deepest node to fill up to (the anchor, or where storage pages landed)
    phase: LoadPhase = LoadPhase.FILLING
    op: int | None = None  # the transfer or storage ticket in flight
    locked: list[RadixNode] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # L1 pages FILLING for this job
    slots: list[int] = field(default_factory=list)  # L2 slots LOADING for this job
    fill_start: int = 0  # page position of fill_pages[0]
    fill_pages: list[int | None] = field(default_factory=list)  # destination per position
    read_settled: bool = True  # False once its read timed out unsettled
    abandoned: bool = False
    # A prefetch (`PageLoads.submit_prefetch`): storage -> L2 only, no L1 pages; DONE once read.
    prefetch: bool = False
    errors: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class WriteJob:
    """An L1 -> L2 copy of the nodes ending at `deepest` (locked until it lands)."""

    deepest: RadixNode
    slots: list[int]
    admit: bool  # store the pages below L2 once they are in L2
    started: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class StoreJob:
    """An L2 -> storage write; `deepest` holds its L2 copies (`host_ref`) until settled."""

    deepest: RadixNode
    slots: list[int]
    started: float = field(default_factory=time.monotonic)
