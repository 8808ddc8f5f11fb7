"""`PublicChains`: which published pages may carry their token ids and their real names.

A `cache_salt` names a tenant's private namespace: its pages chain from the salt's root,
not the shared one. A router needs a page's tokens to match a request to it (vllm-router
and llm-d hash them again); only the pages of the shared (unsalted) namespace go out with
their tokens and their plain block hashes (the low 64 bits of the page hash, the same on
every instance). A page's chain is known from its parent: the pages of a run whose parent
is the unsalted root, or a page known to chain from it, are public, and so is every page
of that run. Every other run (a salt's, or one whose chain this engine never saw) goes
out with no tokens, under names keyed by a secret of this publisher (BLAKE2b, 64 bits):
nothing derived from a salt leaves (not its root, not its pages' hashes), and a router,
which matches by tokens, cannot match anyone's request to them. A first page's parent
(a root) goes out as None, as vLLM's does.

vLLM itself would send a salted block's tokens with the salt in `extra_keys`; vllm-router
0.1.17 ignores `extra_keys` when it matches (its source says so), so doing the same would
let it route one tenant's request on another's pages: docs/fleet.md.

A page hash names its whole chain, so a public page is public in every tier and for
good; the set forgets pages no tier holds any more (`prune`, once it has grown to
`prune_at`: twice what the tiers held at the last prune, and some).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import replace

from asynchicache.common.tiers import BlockStored, TierEvent
from asynchicache.kv_events import wire

PRUNE_SLACK = 4096


class PublicChains:
    def __init__(self, unsalted_root: bytes, key: bytes | None = None) -> None:
        self.root = unsalted_root
        self._key = key if key is not None else secrets.token_bytes(32)
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

    def name(self, page: bytes) -> int:
        """A page's block hash on the wire: plain when public, keyed otherwise."""
        if page in self._public:
            return wire.external_hash(page)
        return int.from_bytes(hashlib.blake2b(page, key=self._key, digest_size=8).digest(), "big")

    def stored(
        self, e: BlockStored, page_size: int, medium: str, owner: str | None
    ) -> wire.BlockStored:
        """`e` (already filtered) as vLLM's event."""
        parent = e.parent_block_hash
        # A salt's root is named like any private page: keyed, so it tells nothing.
        wire_parent = None if parent is None or parent == self.root else self.name(parent)
        return wire.BlockStored(tuple(self.name(h) for h in e.block_hashes), wire_parent,
                                e.token_ids, page_size, medium, ownership=owner)  # fmt: skip

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
