"""Messages between the HTTP server and the engine process (ZeroMQ + msgpack).

Every message is a typed dataclass, encoded and decoded by the one codec
(asynchicache.common.codec); a round-trip test covers each type. Token ids cross the
socket, never text: the HTTP process tokenizes and detokenizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from asynchicache.common.codec import Codec

# The most alternatives a client may ask per token (OpenAI's chat limit; vLLM's default).
MAX_LOGPROBS = 20
# Each distinct cache_salt has a root in the radix tree and is part of every page name of
# its chains (radix.py drops a root once its pages are gone); the server refuses longer
# salts with a 400 and the engine with an error output.
MAX_CACHE_SALT_CHARS = 256
# repetition_penalty divides or multiplies logits: bounded away from 0 and infinity, so
# a penalized logit stays a number (vLLM takes any finite positive value; 1e-308 once
# turned every logit into inf). The server refuses values outside with a 400.
MIN_REPETITION_PENALTY = 0.01
# Below this a temperature is greedy (as in vLLM): logits / 1e-6 overflow float32.
MIN_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class LogitBias:
    """Added to one token's logit before sampling (OpenAI's `logit_bias` entry)."""

    token_id: int
    bias: float


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI names).

    `logprobs` / `prompt_logprobs`: None computes none; k >= 0 returns, per
    sampled (prompt) token, its log-probability and the k most likely
    alternatives, from the raw model distribution (before temperature,
    penalties and top-p). A request with `prompt_logprobs` computes its whole
    prompt: a cached prefix has no logits. `max_tokens` 0 samples nothing
    (the prompt's logprobs are the answer).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of prompt and output tokens
    logit_bias: tuple[LogitBias, ...] = ()
    min_p: float = 0.0  # drop tokens below min_p x the best token's probability (0: off)

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(
                f"max_tokens must be positive (0 only with prompt_logprobs), got {self.max_tokens}"
            )
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed must be in [-2**63, 2**64) (what torch's generators take)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        if any(not -100 <= b.bias <= 100 for b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (penalties or biases)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(frozen=True)
class GenerateRequest:
    """A prompt to complete `n` times: one request group, its prompt computed once.

    Every member streams `TokenOutput`s under the same `rid`, told apart by
    their `index` (0..n-1); member i > 0 of a seeded request draws from a seed
    derived from `seed` and i (`engine.group.member_seed`). `cache_store`
    False: its new pages stay in L1/L2, never stored to disk or Redis.
    """

    rid: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""
    n: int = 1
    cache_store: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class AbortRequest:
    rid: str
    index: int | None = None  # one member of the group; None: every member


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens served from each tier instead of recomputed."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.remote

    def less(self, n: int) -> CachedTokens:
        """These counts with the last `n` tokens (the deepest tiers' first) computed instead."""
        counts = {
            "remote": self.remote,
            "disk": self.disk,
            "host": self.host,
            "device": self.device,
        }
        for tier, have in counts.items():
            take = min(n, have)
            counts[tier] = have - take
            n -= take
        return CachedTokens(**counts)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the raw model distribution, and the most
    likely alternatives at its position (most likely first)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class TokenOutput:
    """New tokens for one member (`index`) of a request; its last has `finished` set.

    `logprobs` runs parallel to `token_ids` when the request asked for them;
    `prompt_logprobs` (prompt tokens 1.., the first has none) comes once, on
    member 0's first output. `cumulative_logprob` sums the member's token
    logprobs so far (when computed).
    """

    rid: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    error: str | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    cumulative_logprob: float = 0.0


@dataclass(frozen=True)
class StepOutputs:
    """Every `TokenOutput` of one engine step, sent as one message: the HTTP process then
    pays one socket read, one decode call and one event-loop wake-up per step, not per
    token of every running request."""

    outputs: tuple[TokenOutput, ...]


@dataclass(frozen=True)
class AdminRequest:
    """A cache admin call answered with an `AdminReply` of the same `req_id`.

    `op` is one of "health", "stats" (counters per tier, pins), "traces" (every
    kept request trace, engine/trace.py), "lookup"
    (tokens of `token_ids` each tier holds, without touching LRU), "clear"
    (`tiers`, default device, host and disk; one `cache_salt`'s pages or all;
    `include_pinned`), "pin" (the pages of `token_ids`, for `ttl_s`), "unpin"
    (`pin_ids`, or the pin of `token_ids`), "integrity" (engine.admin).
    """

    req_id: str
    op: str
    token_ids: tuple[int, ...] = ()
    cache_salt: str = ""
    tiers: tuple[str, ...] = ()
    include_pinned: bool = False
    ttl_s: float | None = None
    pin_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdminReply:
    req_id: str
    ok: bool
    payload: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


CODEC = Codec(
    "engine",
    (
        LogitBias,
        SamplingParams,
        GenerateRequest,
        AbortRequest,
        CachedTokens,
        TokenLogprob,
        TokenOutput,
        StepOutputs,
        AdminRequest,
        AdminReply,
    ),
)
MESSAGE_TYPES = CODEC.messages
encode = CODEC.encode
decode = CODEC.decode  # ValueError on anything malformed or mistyped
