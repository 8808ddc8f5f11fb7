"""One request's way to an external hit: page hashes, then L2, then the service.

A `Lookup` is what `get_num_new_matched_tokens` builds for a request and asks
again until it is answered:

    ASKING   the service is asked how far the chain exists beyond L2 (`Exists`)
    ROOM     the service holds pages, L2 has no free or unread slots for them
             yet (its pages are being stored or copied): asked again next step,
             until the prefetch deadline, then what fits is read
    LOADING  the existing pages are being read into L2 slots (a `Load` ticket)
    ANSWERED the hit is known: `answer_pages` pages, all verified in L2 and
             held there (readers), so the copy into vLLM's blocks cannot fail

The answer is given only once the pages sit verified in L2: a slow, dead or
corrupt tier costs a shorter hit (recompute), never a failed request and never
unverified KV handed to vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto

import xxhash

from asynchicache.common.keys import chain_hashes, tokens_bytes


@dataclass(frozen=True)
class MMSpan:
    """A multimodal item's placeholder tokens: `length` from `offset`, and its content hash."""

    offset: int
    length: int
    identifier: str

    def key_in(self, start: int, end: int) -> bytes:
        """What this item adds to the name of the page of tokens [start, end) (nothing
        if the page holds none of its placeholders): its hash and offset in the page,
        as vLLM's block hashes have them."""
        if self.offset >= end or self.offset + self.length <= start:
            return b""
        rel = (self.offset - start).to_bytes(8, "little", signed=True)
        return self.identifier.encode() + b"\x00" + rel


class RequestChain:
    """The chained page hashes of one request's tokens, grown as tokens arrive.

    `root` names everything the tokens do not (namespace, salt, LoRA adapter);
    pages that hold multimodal placeholders also hash their items (`MMSpan`).
    """

    def __init__(self, root: bytes, page_size: int, spans: Sequence[MMSpan] = ()) -> None:
        self.root = root
        self.page_size = page_size
        self.spans = tuple(spans)
        self.hashes: list[bytes] = []

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Hash the full pages of `tokens` not hashed yet; returns all hashes."""
        done, size = len(self.hashes), self.page_size
        full = len(tokens) // size
        if full <= done:
            return self.hashes
        if not self.spans:
            self.hashes += chain_hashes(self.parent(done), tokens, size, start_page=done)
            return self.hashes
        for page in range(done, full):
            start, end = page * size, (page + 1) * size
            extra = b"".join(span.key_in(start, end) for span in self.spans)
            data = self.parent(page) + tokens_bytes(tokens[start:end])
            if extra:
                data += b"\x00mm\x00" + extra
            self.hashes.append(xxhash.xxh3_128_digest(data))
        return self.hashes

    def parent(self, page: int) -> bytes:
        return self.root if page == 0 else self.hashes[page - 1]


class Phase(Enum):
    ASKING = auto()
    ROOM = auto()
    LOADING = auto()
    ANSWERED = auto()


@dataclass(frozen=True)
class TierSplit:
    """Pages of a hit by the tier they came from (host = L2, disk = L3, remote = L4)."""

    host: int = 0
    disk: int = 0
    remote: int = 0


@dataclass
class Lookup:
    """The state of one request's lookup (see the module docstring)."""

    key: int
    req_id: str
    first_page: int  # pages vLLM holds already (its own prefix cache, block-aligned)
    want_pages: int  # pages past `first_page` that could be hit (never the last token)
    started: float
    phase: Phase = Phase.ASKING
    host_slots: list[int] = field(default_factory=list)  # L2 hits held as readers, in chain order
    loaded_slots: list[int] = field(default_factory=list)  # held as readers, read by the prefetch
    from_remote: int = 0  # of `loaded_slots`, how many came from L4
    service_pages: int = 0  # pages past L2's that the service holds (ROOM)
    load_job: int = 0  # the prefetch (LOADING)
    loading_since: float = 0.0  # the service's answer: ROOM and LOADING share one deadline
    answer_pages: int = 0
    committed: bool = False  # vLLM took the hit (a load job holds the pins now)

    @property
    def slots(self) -> list[int]:
        return self.host_slots + self.loaded_slots

    @property
    def next_page(self) -> int:
        """The first page (chain index) that L2 does not hold for this lookup."""
        return self.first_page + len(self.host_slots) + len(self.loaded_slots)

    def split(self, pages: int) -> TierSplit:
        """Where the first `pages` pages of the hit came from (L2, then disk, then L4)."""
        host = min(pages, len(self.host_slots))
        rest = pages - host
        disk = min(rest, len(self.loaded_slots) - self.from_remote)
        return TierSplit(host, disk, rest - disk)
