"""What the scheduler gets back from the cache: opaque handles and match results."""

from __future__ import annotations

from dataclasses import dataclass, field

from asynchicache.hierarchy.node import RadixNode


@dataclass(frozen=True, eq=False)
class MatchHandle:
    """Opaque: names a node of the tree for `lock`/`unlock`/`load`."""

    node: RadixNode
    tokens: list[int] = field(default_factory=list, repr=False)
    storage_hashes: tuple[bytes, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a prompt, tier by tier (pages, fastest tier first)."""

    device_pages: list[int]
    host_hit_pages: int
    storage_hit_pages: int
    handle: MatchHandle
    page_size: int

    @property
    def device_tokens(self) -> int:
        return len(self.device_pages) * self.page_size

    @property
    def cached_tokens(self) -> int:
        """Tokens of the prefix found in any tier (device + host + storage)."""
        return (len(self.device_pages) + self.host_hit_pages + self.storage_hit_pages) * (
            self.page_size
        )


@dataclass(frozen=True)
class LockedPages:
    """Pages handed to the caller with a lock it must `unlock` (`handle`).

    From `insert`: the inserted path, and the canonical page list for the
    caller's table (the tree's pages where it had them, a trailing partial page
    still the caller's). From `give_up`: a given-up load's L1 prefix.
    """

    handle: MatchHandle
    device_pages: list[int]
