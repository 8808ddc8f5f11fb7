"""`PublicChains`: which published pages may carry their token ids.

A `cache_salt` names a tenant's private namespace: its pages chain from the salt's
root, not the shared one. A router needs page hashes to route; only the pages of the
shared (unsalted) namespace also go out with their tokens, as vLLM's events do. A
page's chain is known from its parent: the pages of a `BlockStored` whose parent is
the unsalted root, or a page known to chain from it, are public, and so is every page
of that run. Every other run (a salt's, or one whose chain this engine never saw)
goes out as hashes only: unknown counts as private.

A page hash names its whole chain, so a public page is public in every tier and for
good; the set forgets pages no tier holds any more (`prune`, once it has grown to
`prune_at`: twice what the tiers held at the last prune, and some).
"""

from __future__ import annotations

from dataclasses import replace

from asynchicache.tiers import BlockStored, TierEvent

PRUNE_SLACK = 4096


class PublicChains:
    def __init__(self, unsalted_root: bytes) -> None:
        self.root = unsalted_root
        self._public: set[bytes] = set()
        self.prune_at = PRUNE_SLACK

    def __len__(self) -> int:
        return len(self._public)

    def filter(self, events: list[TierEvent]) -> list[TierEvent]:
        """`events` with the token ids of every run not known to be public left out."""
        self._learn(events)
        return [
            replace(e, token_ids=())
            if isinstance(e, BlockStored)
            and e.token_ids
            and not self._is_public_parent(e.parent_block_hash)
            else e
            for e in events
        ]

    def _is_public_parent(self, parent: bytes | None) -> bool:
        return parent == self.root or parent in self._public

    def _learn(self, events: list[TierEvent]) -> None:
        """Take the public runs of `events`, in any order (a run may come before the run
        of its parent, from another tier)."""
        pending = [e for e in events if isinstance(e, BlockStored) and e.block_hashes]
        while pending:
            later = []
            for e in pending:
                if self._is_public_parent(e.parent_block_hash):
                    self._public.update(e.block_hashes)
                else:
                    later.append(e)
            if len(later) == len(pending):
                return
            pending = later

    def prune(self, held: set[bytes]) -> None:
        """Forget the pages no tier holds (`held`: every tier's pages)."""
        self._public.intersection_update(held)
        self.prune_at = 2 * len(held) + PRUNE_SLACK
