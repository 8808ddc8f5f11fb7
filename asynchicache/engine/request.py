"""A request's state inside the engine: its tokens, pages and phase."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from asynchicache.engine.protocol import CachedTokens, SamplingParams, TokenLogprob
from asynchicache.hierarchy.l2.jobs import LoadTicket
from asynchicache.hierarchy.results import MatchHandle


class Phase(Enum):
    WAITING = auto()  # queued; its prefix has not been matched yet
    LOADING = auto()  # its prefix is being copied up from L2/L3/L4
    RUNNING = auto()  # prefilling in chunks, then decoding one token a step
    FINISHED = auto()


@dataclass
class SharedPages:
    """Private prompt pages shared by the members of a group (no prefix cache)."""

    pages: list[int]
    holders: int = 0

    def release(self) -> list[int]:
        """One member lets go; returns the pages to free when it was the last."""
        self.holders -= 1
        if self.holders < 0:
            raise RuntimeError("SharedPages released more often than held")
        return self.pages if self.holders == 0 else []


@dataclass
class RequestGroup:
    """The members still waiting for the leader's prefill (engine/group.py forks them)."""

    followers: list[Request] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One generation request.

    Page ownership: `page_table[:shared_pages]` belong to the radix tree and are
    protected by the locked `handle`; the rest were allocated for this request
    alone and are freed (or handed to the tree) when it ends.
    """

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    cache_salt: str = ""
    cache_store: bool = True  # False: its pages never go below L2 (disk, Redis)
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    page_table: list[int] = field(default_factory=list)
    shared_pages: int = 0
    num_computed: int = 0  # tokens whose KV is in page_table
    handle: MatchHandle | None = None  # the lock on page_table[:shared_pages]
    load_ticket: LoadTicket | None = None  # while LOADING
    load_deadline: float | None = None
    # Its collected loads (engine/trace.py): submit-to-done seconds, and pages by tier.
    load_ticket_s: float = 0.0
    loaded_host_pages: int = 0
    loaded_storage_pages: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    usage_final: bool = False  # `cached` was set at its first admission (it was preempted)
    # Prompt tokens its arrival prefetch moved into L2, by the tier they came from
    # (engine/scheduling/prefetch.py): its usage counts them there, not as L2 hits.
    prefetched: CachedTokens = field(default_factory=CachedTokens)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    error: str | None = None
    # What the OpenAI surface adds (logprobs, request groups): see engine/group.py.
    index: int = 0  # member of its request group
    group: RequestGroup | None = None  # while members wait for the shared prefill
    shared: SharedPages | None = None  # prompt pages held with the other members (no tree)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    @property
    def needs_whole_prompt(self) -> bool:
        """Prompt logprobs need logits a cached prefix lacks: compute every prompt token."""
        return self.sampling.prompt_logprobs is not None and not self.output

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far: what the KV must cover before the next sample."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.remaining > 1
