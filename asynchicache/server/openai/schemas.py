"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate types and ranges here, so a bad field becomes a 400 before
anything reaches the engine. Unknown fields are ignored, as OpenAI's own server
does for fields it does not know; fields we know but do not implement
(`suffix`) and combinations that make no sense (`best_of < n`) are rejected in
`server/openai/requests.py`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from asynchicache.common.tiers import TIERS, Tier, TierName
from asynchicache.engine.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)

# Samples per prompt (n, best_of): each is a running request in the engine.
MAX_SAMPLES = 32
# Each entry is applied to the logits at every step of the request.
MAX_LOGIT_BIAS = 1024
# Every stop string is searched in the text after each token.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# ...and all of them together (the automaton of server/openai/stop.py holds a state per character).
MAX_STOP_TOTAL_CHARS = 4096


def _utf8(value: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); no tokenizer or encoder downstream takes them.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {exc.reason}") from exc
    return value


Text = Annotated[str, AfterValidator(_utf8)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_utf8)]
SaltText = Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS), AfterValidator(_utf8)]


def _prompt_kind(value: object) -> str | None:
    """Which shape a completions `prompt` is, from its type and its first item's: a long
    list is then checked against that one type. (A plain union tried every member and
    collected an error per item for each: 3-4 s of event loop for a million token ids.)"""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"


# One prompt (text or token ids) or a list of them.
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], Tag("texts")]
    | Annotated[list[int], Tag("ids")]
    | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="prompt must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
    ),
]


# Requests are strict: "5" is not an int and "yes" is not a bool, as in OpenAI's API.
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions.

    Every number is bounded to what the sampler computes with (see
    `engine.protocol.SamplingParams`): NaN, infinities and values outside are a 400
    naming the field, never an engine error.
    """

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (completions)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # vLLM's; -1 and 0 disable it
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch accepts
    stop: StopText | list[StopText] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    best_of: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: SaltText | None = None  # per-request cache namespace, as vLLM names it
    cache_store: bool = True  # False: this request's pages never go to disk or Redis
    ignore_eos: bool = False  # vLLM extension: keep going past end-of-sequence
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    # Token id (as a string, as JSON keys are) -> bias added to its logit.
    logit_bias: dict[Text, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS
    )

    @field_validator("stop")
    @classmethod
    def _stop_total(cls, stop: str | list[str] | None) -> str | list[str] | None:
        total = sum(map(len, [stop] if isinstance(stop, str) else stop or ()))
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(
                f"the stop strings have {total} characters in all; this server takes at most "
                f"{MAX_STOP_TOTAL_CHARS} characters ({MAX_STOP_STRINGS} strings of at most "
                f"{MAX_STOP_CHARS})"
            )
        return stop

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a list of them: a choice per prompt and sample.
    prompt: Prompt
    echo: bool = False
    suffix: Text | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (the newer name) wins over `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


class LookupRequest(BaseModel):
    """`/cache/lookup`: a prompt (text or token ids) or chat messages, exactly one."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: Text | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    cache_salt: SaltText | None = None


CLEAR_SCOPES = (*TIERS, "all")


class ClearRequest(BaseModel):
    """`/cache/clear`: which tiers (default device, host and disk), whose pages (one
    `cache_salt`, or everyone's), and whether pinned pages go too."""

    model_config = ConfigDict(extra="forbid", strict=True)

    scope: Literal[TierName, "all"] | list[Literal[TierName, "all"]] | None = None
    cache_salt: SaltText | None = None
    include_pinned: bool = False

    @property
    def tiers(self) -> tuple[str, ...]:
        if self.scope is None:
            return (Tier.DEVICE.value, Tier.HOST.value, Tier.DISK.value)
        scope = [self.scope] if isinstance(self.scope, str) else self.scope
        return TIERS if "all" in scope else tuple(t for t in TIERS if t in scope)


class PinRequest(LookupRequest):
    """`/cache/pin`: a prompt (or messages) whose full pages stay cached, for `ttl_s`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ttl_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class UnpinRequest(LookupRequest):
    """`/cache/unpin`: pins by id (`pin_id` / `pin_ids`), or the pin of a prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)

    pin_id: Annotated[str, Field(pattern="^[0-9a-f]{32}$")] | None = None
    pin_ids: list[Annotated[str, Field(pattern="^[0-9a-f]{32}$")]] | None = Field(
        default=None, min_length=1
    )


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Extension: where the cached prompt tokens came from.
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=lambda: dict.fromkeys(TIERS, 0))


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Legacy completions shape: parallel lists, one entry per token (echoed prompt first)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # null on every chunk but the usage chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asynchicache"
    root: str | None = None  # vLLM's: what the model was loaded from (its id here)
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
