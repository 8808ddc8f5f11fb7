"""Messages between the HTTP server and the engine process (ZeroMQ + msgpack).

Every message is a typed dataclass; `encode`/`decode` are the only codec and a
round-trip test covers each type. Token ids cross the socket, never text: the
HTTP process tokenizes and detokenizes.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgpack

# The most alternatives a client may ask per token (OpenAI's chat limit; vLLM's default).
MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(
                f"max_tokens must be positive (0 only with prompt_logprobs), got {self.max_tokens}"
            )
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100 <= b.bias <= 100 for b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (penalties or biases)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
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
        counts = {"remote": self.remote, "disk": self.disk, "host": self.host,
                  "device": self.device}
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

    `op` is one of "health", "stats" (counters per tier, pins), "lookup"
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


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
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
    )
}


# Each message type's field annotations, resolved once (typing.get_type_hints evaluates
# the string annotations anew on every call: most of a decode's time when it ran per message).
FIELD_HINTS: Mapping[type, Mapping[str, Any]] = MappingProxyType({
    cls: MappingProxyType(typing.get_type_hints(cls)) for cls in MESSAGE_TYPES.values()
})


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        body = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__t": type(obj).__name__, **body}
    if isinstance(obj, list | tuple):
        if all(type(x) is int for x in obj):  # token ids: no element needs converting
            return list(obj)
        return [_to_plain(x) for x in obj]
    return obj


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict) and "__t" in obj:
        cls = MESSAGE_TYPES.get(obj["__t"])
        if cls is None:
            raise ValueError(f"unknown message type {obj['__t']!r}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in obj:
                value = _from_plain(obj[f.name])
                kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)
    if isinstance(obj, list):
        if all(type(x) is int for x in obj):  # token ids
            return obj
        return [_from_plain(x) for x in obj]
    return obj


def encode(msg: Any) -> bytes:
    return msgpack.packb(_to_plain(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode one message; raises ValueError on anything malformed or mistyped."""
    try:
        plain = msgpack.unpackb(data, raw=False)
        msg = _from_plain(plain)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed engine message: {exc}") from exc
    if not dataclasses.is_dataclass(msg):
        raise ValueError("malformed engine message: not a typed message")
    _check_types(msg)
    return msg


def _check_types(msg: Any) -> None:
    """Every field holds what its annotation says (a mistyped field would fail deep in the
    engine, taking it down, instead of here)."""
    hints = FIELD_HINTS[type(msg)]
    for f in dataclasses.fields(msg):
        if not _conforms(getattr(msg, f.name), hints[f.name]):
            raise ValueError(f"malformed engine message: {type(msg).__name__}.{f.name} mistyped")


def _conforms(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if item is int:  # token ids, thousands of them: one pass, no call per element
            return isinstance(value, tuple) and all(type(v) is int for v in value)
        return isinstance(value, tuple) and all(_conforms(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            _check_types(value)
            return True
        return False
    if hint is float:  # msgpack keeps 0 an int
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
