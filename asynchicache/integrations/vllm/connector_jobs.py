"""The scheduler side's jobs: who fills or reads which L2 slots, until it reports.

Worker copies (COPY_IN, SAVE_COPY) are `HostTier.jobs`'; service tickets (PREFETCH,
STORE) are booked in `HostTier.tickets`, the L2 ticket lifecycle our hierarchy shares
(hierarchy/l2/slot_tickets.py: landed, empty and quarantined slots, given-up loads,
`Settled`). What stays here is vLLM's: the request a job serves, its lookup, and how
its pages are named in KV events."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from asynchicache.storage.base import PageRef


class JobKind(Enum):
    PREFETCH = auto()  # service: L3/L4 -> L2 slots (WRITING until done)
    COPY_IN = auto()  # worker: L2 slots (with readers) -> vLLM blocks
    SAVE_COPY = auto()  # worker: vLLM blocks -> L2 slots (WRITING until done)
    STORE = auto()  # service: L2 slots (with readers) -> L3/L4


@dataclass
class Job:
    kind: JobKind
    req_id: str
    slots: list[int]
    pages: list[PageRef] = field(default_factory=list)  # PREFETCH/SAVE_COPY: what the slots get
    lookup_key: int = 0
    # Its request's chain root and LoRA name when it was registered (host_tier.py), for the
    # KV events of its pages: the request may be gone when the job is done, and a first
    # page is known as one by its parent being the root
    described: tuple[bytes | None, str | None] | None = None
