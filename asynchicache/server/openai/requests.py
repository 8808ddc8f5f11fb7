"""From a validated request body to engine requests, and the plan of how to answer.

Everything a client can get wrong is checked here, before the engine sees the
request, and answered with a 400/404 in OpenAI's error shape naming the field.
A completions body with a list of prompts becomes one engine request per
prompt; `n` / `best_of` become the size of each one's request group.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import cast

from asynchicache.engine.protocol import (
    MIN_TEMPERATURE,
    GenerateRequest,
    LogitBias,
    SamplingParams,
)
from asynchicache.server.context import AppContext
from asynchicache.server.errors import APIError
from asynchicache.server.guards.work_bound import Work, check_work, fit_default, request_token_limit
from asynchicache.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from asynchicache.server.openai.stop import StopMatcher

# OpenAI's default for the legacy completions endpoint; chat defaults to the
# rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Prompts x samples one completions call may ask (each is a running engine request).
MAX_CHOICES = 256


@dataclass(frozen=True)
class Plan:
    """What one HTTP request runs in the engine and how its answer is framed.

    `requests[i]` is prompt i's request group of `best_of` members; the answer
    keeps `n` choices per prompt (the best by cumulative logprob when
    best_of > n), choice index `i * n + j`.
    """

    rid: str  # the response's id; prompt i's engine request is `{rid}-{i}` when several
    requests: tuple[GenerateRequest, ...]
    n: int
    best_of: int
    logprobs: int | None  # alternatives per generated token the client asked for
    echo: bool = False
    # The stop strings, compiled here (off the event loop) once for every sample.
    stops: StopMatcher = field(default_factory=lambda: StopMatcher(()))


# ------------------------------------------------------------------ validation
def check_model(ctx: AppContext, model: str | None) -> None:
    if model is not None and model != ctx.model.name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{ctx.model.name}`.",
            param="model",
            code="model_not_found",
        )


def _check_ids(ctx: AppContext, ids: list[int]) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    bad = next((t for t in ids if not 0 <= t < ctx.model.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} is outside the vocabulary (0..{ctx.model.vocab_size - 1})",
            param="prompt",
        )


def _check_least_fits(ctx: AppContext, least: int, param: str) -> None:
    """A prompt whose text alone proves it longer than the context is refused as such
    (context_length_exceeded, as OpenAI's API answers) before the work bound and before
    it is tokenized."""
    limit = ctx.model.max_model_len
    if least >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has at "
            f"least {least} tokens. Please shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def _max_tokens(
    ctx: AppContext, prompt_len: int, requested: int | None, default: int | None
) -> int:
    """The completion budget; a prompt or budget beyond the context is the client's error."""
    limit = ctx.model.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens. Please shorten the prompt.",
            param="messages" if default is None else "prompt",
            code="context_length_exceeded",
        )
    room = limit - prompt_len
    if requested is None:
        return min(default, room) if default is not None else room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _samples(body: SamplingFields) -> tuple[int, int]:
    """(n, best_of), checked together."""
    best_of = body.n if body.best_of is None else body.best_of
    if best_of < body.n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({body.n})", param="best_of")
    if body.stream and best_of > body.n:
        raise APIError(400, "best_of > n cannot be streamed", param="best_of")
    return body.n, best_of


def _logit_bias(ctx: AppContext, body: SamplingFields) -> tuple[LogitBias, ...]:
    """One entry per token: "50" and "050" name one token, and the engine would add both
    biases (past +-100), so naming a token twice is a 400."""
    biases: dict[int, LogitBias] = {}
    keys: dict[int, str] = {}
    for key, bias in (body.logit_bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < ctx.model.vocab_size:
            raise APIError(
                400,
                f"logit_bias key {key[:20]!r} is not a token id (0..{ctx.model.vocab_size - 1})",
                param="logit_bias",
            )
        if token in keys:
            raise APIError(
                400,
                f"logit_bias names token {token} twice ({keys[token]!r} and {key[:20]!r})",
                param="logit_bias",
            )
        keys[token] = key[:20]
        biases[token] = LogitBias(token, bias)
    return tuple(biases[t] for t in sorted(biases))


def _sampling(
    ctx: AppContext,
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(ctx, body),
        min_p=body.min_p or 0.0,
    )


def _work_limit(ctx: AppContext) -> int:
    return request_token_limit(ctx.max_request_tokens, ctx.model.max_model_len)


def _engine_logprobs(asked: int | None, n: int, best_of: int) -> int | None:
    """best_of ranks members by cumulative logprob: the engine computes it even unasked."""
    return 0 if asked is None and best_of > n else asked


# ------------------------------------------------------------------ prompts
def _completion_items(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts, untokenized: several (texts, or id lists), or one (a text, an id list)."""
    prompt = body.prompt
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items = cast(list[str | list[int]], list(prompt) if many else [prompt])
    if not items or (isinstance(prompt, list) and not prompt):
        raise APIError(400, "the prompt is empty", param="prompt")
    return items


def _fewest_tokens(ctx: AppContext, item: str | list[int]) -> int:
    return ctx.tokenizer.fewest_tokens(item) if isinstance(item, str) else len(item)


def _tokenize(ctx: AppContext, item: str | list[int]) -> list[int]:
    if isinstance(item, str):
        return ctx.tokenizer.encode(item, add_special_tokens=False)
    return [int(t) for t in item]


def _chat_text(ctx: AppContext, body: ChatCompletionRequest) -> str:
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # a template raising on an odd conversation is the input's fault
        raise APIError(
            400, f"the chat template rejected these messages: {exc}", param="messages"
        ) from exc


def _chat_ids(ctx: AppContext, body: ChatCompletionRequest) -> list[int]:
    return ctx.tokenizer.encode(_chat_text(ctx, body), add_special_tokens=False)


def _salt(body: SamplingFields) -> str:
    return body.cache_salt or ""


# ------------------------------------------------------------------ plans
def plan_completion(ctx: AppContext, body: CompletionRequest) -> Plan:
    check_model(ctx, body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 is only allowed with echo", param="max_tokens")
    n, best_of = _samples(body)
    items = _completion_items(body)
    if len(items) * best_of > MAX_CHOICES:  # before a single prompt is tokenized
        raise APIError(
            400,
            f"{len(items)} prompts x {best_of} samples is more than {MAX_CHOICES}",
            param="prompt",
        )
    logprobs = _engine_logprobs(body.logprobs, n, best_of)
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0:  # the prompt is computed all the same (and its pages stored)
        prompt_logprobs = prompt_logprobs or 0
    limit = _work_limit(ctx)

    def work(counts: list[int], estimated: bool) -> Work:
        echoed = sum(counts) if prompt_logprobs is not None else 0
        return Work(len(counts), n, best_of, body.logprobs, echoed, prompt_tokens=sum(counts),
                    estimated=estimated)  # fmt: skip

    # The text's length proves a least token count: a request past the bound on that
    # alone is refused before it is tokenized.
    least = [_fewest_tokens(ctx, i) for i in items]
    _check_least_fits(ctx, max(least, default=0), "prompt")
    check_work(limit, work(least, True), 0)
    prompts = [_tokenize(ctx, item) for item in items]
    exact = work(list(map(len, prompts)), False)
    budgets = []
    for ids in prompts:
        _check_ids(ctx, ids)
        budget = _max_tokens(ctx, len(ids), body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
        budgets.append(budget if body.max_tokens is not None else fit_default(limit, exact, budget))
    check_work(limit, exact, max(budgets))
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests = []
    for i, (ids, max_tokens) in enumerate(zip(prompts, budgets, strict=True)):
        sampling = _sampling(ctx, body, max_tokens, logprobs, prompt_logprobs)
        req_id = rid if len(prompts) == 1 else f"{rid}-{i}"
        requests.append(
            GenerateRequest(req_id, tuple(ids), sampling, _salt(body), best_of, body.cache_store)
        )
    return Plan(rid, tuple(requests), n, best_of, body.logprobs, body.echo,
                StopMatcher(body.stop_list))  # fmt: skip


def plan_chat(ctx: AppContext, body: ChatCompletionRequest) -> Plan:
    check_model(ctx, body.model)
    if body.max_tokens == 0 and body.max_completion_tokens is None:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n, best_of = _samples(body)
    if best_of > MAX_CHOICES:
        raise APIError(400, f"best_of is more than {MAX_CHOICES}", param="best_of")
    asked = (body.top_logprobs or 0) if body.logprobs else None
    limit = _work_limit(ctx)
    text = _chat_text(ctx, body)
    fewest = ctx.tokenizer.fewest_tokens(text)
    _check_least_fits(ctx, fewest, "messages")
    least = Work(1, n, best_of, asked, logprobs_field="top_logprobs",
                 prompt_tokens=fewest, estimated=True)  # fmt: skip
    check_work(limit, least, 0)  # before the text is tokenized
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    _check_ids(ctx, ids)
    max_tokens = _max_tokens(ctx, len(ids), body.token_limit, None)
    work = Work(1, n, best_of, asked, logprobs_field="top_logprobs", prompt_tokens=len(ids))
    if body.token_limit is None:  # the rest of the context, as much of it as the bound allows
        max_tokens = fit_default(limit, work, max_tokens)
    check_work(limit, work, max_tokens)
    sampling = _sampling(ctx, body, max_tokens, _engine_logprobs(asked, n, best_of), None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    req = GenerateRequest(rid, tuple(ids), sampling, _salt(body), best_of, body.cache_store)
    return Plan(rid, (req,), n, best_of, asked, stops=StopMatcher(body.stop_list))


def chat_prompt_ids(ctx: AppContext, body: ChatCompletionRequest) -> list[int]:
    """The chat prompt's token ids (for `/cache/lookup` and the render route)."""
    return _chat_ids(ctx, body)


def completion_prompt_ids(ctx: AppContext, body: CompletionRequest) -> list[list[int]]:
    """Each completion prompt's token ids as `plan_completion` makes them (for the render
    route, server/openai/render_routes.py); 400 past MAX_CHOICES prompts, or a prompt whose text
    alone is longer than the context (before it is tokenized), or a bad id."""
    items = _completion_items(body)
    if len(items) > MAX_CHOICES:
        raise APIError(400, f"more than {MAX_CHOICES} prompts", param="prompt")
    context = ctx.model.max_model_len
    if any(_fewest_tokens(ctx, item) > context for item in items):
        raise APIError(400, f"a prompt is longer than the context ({context} tokens)",
                       param="prompt")  # fmt: skip
    prompts = [_tokenize(ctx, item) for item in items]
    for ids in prompts:
        _check_ids(ctx, ids)
    return prompts
