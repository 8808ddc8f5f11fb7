"""Request groups: `n` samples of one prompt over one prefill.

A `GenerateRequest` with n > 1 becomes n member `Request`s sharing its rid,
told apart by `index`. Only member 0 (the leader) enters the scheduler; the
others wait in its `RequestGroup` until the leader's prompt is computed. In
that step `fork` gives each follower the leader's prompt KV:

* the full prompt pages are shared, not copied. With the prefix cache they are
  the tree's, and each member locks the leader's handle once (its own lock,
  released when it ends, as for any request). Without it they stay private
  pages held by a `SharedPages` count, freed when the last member lets go.
* the last, partial page is written by every member's next tokens, so each
  follower gets its own copy of it (one page copy on the device).

Then every member samples its first token from the leader's logits with its
own generator: member i of a seeded request draws from `member_seed(seed, i)`,
so results repeat and members differ. From there each member is an ordinary
request: decoded, preempted, stopped and aborted on its own. Aborting the rid
ends every member; when the leader ends before the fork (abort, error), its
waiting followers end with it.

Invariant: every member holds the shared prompt pages once (a lock or a
count) from the fork until it ends or is preempted, and nothing else does.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from asynchicache.engine.protocol import GenerateRequest
from asynchicache.engine.request import Phase, Request, RequestGroup, SharedPages
from asynchicache.engine.sampling.sampler import request_generator
from asynchicache.engine.scheduling.scheduler import Scheduler

SEED_BITS = 63


def member_seed(seed: int | None, index: int) -> int | None:
    """Member `index`'s seed: the request's own for member 0 (so n=1 and a single request
    agree), a hash of (seed, index) reduced to 63 bits for the others (never overflows
    what torch accepts; independent streams)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def make_members(msg: GenerateRequest) -> list[Request]:
    """The group's members; the leader (index 0) carries the others in its `group`."""
    members = []
    for i in range(msg.n):
        sampling = dataclasses.replace(msg.sampling, seed=member_seed(msg.sampling.seed, i))
        members.append(
            Request(
                msg.rid,
                list(msg.prompt_token_ids),
                sampling,
                msg.cache_salt,
                msg.cache_store,
                index=i,
            )
        )
    if msg.n > 1:
        members[0].group = RequestGroup(members[1:])
    return members


class Forker:
    """Hands a leader's computed prompt to its followers (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, kv_pool: torch.Tensor) -> None:
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.kv_pool = kv_pool  # [pages, layers, 2, page_size, kv_heads, head_dim]

    def fork(self, leader: Request) -> list[Request]:
        """Followers that sample in this step with the leader's logits (others, whose
        partial page found no room, recompute the prompt's tail first)."""
        group, leader.group = leader.group, None
        if group is None or not group.followers:
            return []
        if leader.sampling.max_tokens == 0:  # prompt logprobs only: nothing to decode
            for f in group.followers:
                self.scheduler.finish(f, "length")
            return []
        page_size = self.scheduler.page_size
        shared = self._share(leader, group.followers, len(leader.prompt) // page_size)
        copied = self._copy_partial(leader, group.followers, shared, page_size)
        ready = []
        for f in group.followers:
            f.cached = leader.cached
            if not f.sampling.greedy:
                f.generator = request_generator(f.sampling.seed)
            f.phase = Phase.RUNNING
            self.scheduler.running.append(f)
            f.num_computed = len(leader.prompt) if id(f) in copied else shared * page_size
            if id(f) in copied:
                ready.append(f)
        return ready

    def _share(self, leader: Request, followers: list[Request], full: int) -> int:
        """Share the leader's full prompt pages; returns how many."""
        if self.scheduler.cache_config.enable_prefix_cache:
            # After its prefill the leader's full pages are the tree's (`_publish_computed`).
            shared = leader.shared_pages
            for f in followers:  # one lock per member
                if leader.handle is not None:
                    self.cache.lock(leader.handle)
                    f.handle = leader.handle
        else:
            shared = full
            if full:
                pages = SharedPages(leader.page_table[:full], holders=1 + len(followers))
                leader.shared, leader.shared_pages = pages, full
                for f in followers:
                    f.shared = pages
        for f in followers:
            f.page_table = leader.page_table[:shared]
            f.shared_pages = shared
        return shared

    def _copy_partial(
        self, leader: Request, followers: list[Request], shared: int, page_size: int
    ) -> set[int]:
        """Give each follower its own copy of the prompt's partial last page; returns the
        ids of the followers whose prompt KV is now complete."""
        if shared * page_size == len(leader.prompt):
            return {id(f) for f in followers}
        if shared != len(leader.prompt) // page_size:
            return set()  # not all full pages are shared: they recompute the rest
        got: list[Request] = []
        pages: list[int] = []
        for f in followers:
            page = self.cache.allocate(1)
            if page is None:
                break
            f.page_table.append(page[0])
            got.append(f)
            pages += page
        if pages:
            src = leader.page_table[shared]
            dst = torch.tensor(pages, device=self.kv_pool.device)
            # A copy first: index_copy_ refuses a source inside the tensor it writes.
            one = self.kv_pool[src : src + 1].clone()  # [1, layers, 2, page_size, heads, hd]
            block = one.expand(len(pages), *self.kv_pool.shape[1:])
            self.kv_pool.index_copy_(0, dst, block)
        return {id(f) for f in got}

    def end_waiting(self, leader: Request) -> None:
        """The leader ended before its prompt was computed: so do the waiting followers."""
        group, leader.group = leader.group, None
        for f in group.followers if group is not None else ():
            self.scheduler.finish(f, leader.finish_reason or "abort")
            f.error = leader.error
