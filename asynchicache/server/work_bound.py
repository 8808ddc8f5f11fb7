"""How much engine work one HTTP request may ask for (`--max-request-tokens`).

A body of 100 bytes can ask for `prompts x best_of x max_tokens` generated
tokens (each of the `best_of` samples of each prompt runs to `max_tokens` in
the engine; `n <= best_of` only picks which to return), and for logprobs of
every one of them: once 32 x 32 x 1,000 tokens with 20 logprobs each, 462 s of
engine time and a 17 MB answer. Two bounds, both a 400 that names the fields:

* generated tokens: `prompts x best_of x max_tokens <= max_request_tokens`. A
  `max_tokens` the client did not give (chat's "the rest of the context") is
  shrunk to fit instead of refused;
* logprob entries returned: `(prompts x n x max_tokens + echoed prompt tokens) x
  (1 + logprobs) <= LOGPROB_ENTRIES_PER_TOKEN x max_request_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from asynchicache.server.errors import APIError

# Without --max-request-tokens: this many, or two whole contexts when that is more.
DEFAULT_MAX_REQUEST_TOKENS = 16_384
# Logprob entries (a token or an alternative) an answer may carry per bound token.
LOGPROB_ENTRIES_PER_TOKEN = 4


def request_token_limit(configured: int | None, max_model_len: int) -> int:
    """The bound in force: the flag's value, or the default for this context length."""
    if configured is not None:
        return configured
    return max(DEFAULT_MAX_REQUEST_TOKENS, 2 * max_model_len)


@dataclass(frozen=True)
class Work:
    """What one request asks of the engine, per prompt."""

    prompts: int
    n: int
    best_of: int
    logprobs: int | None  # alternatives per returned token, None: no logprobs
    echo_tokens: int = 0  # prompt tokens returned with logprobs (echo)
    logprobs_field: str = "logprobs"  # what the client called it (chat: top_logprobs)


def fit_default(limit: int, work: Work, default: int) -> int:
    """A defaulted `max_tokens` shrunk so that the request fits the bound (at least 1)."""
    return max(1, min(default, limit // (work.prompts * work.best_of)))


def check_work(limit: int, work: Work, max_tokens: int) -> None:
    """400 when `work` with `max_tokens` per sample passes either bound."""
    generated = work.prompts * work.best_of * max_tokens
    if generated > limit:
        raise APIError(
            400,
            f"this request may generate {generated} tokens ({work.prompts} prompt(s) x "
            f"best_of {work.best_of} x max_tokens {max_tokens}); this server allows {limit} "
            "per request (--max-request-tokens): lower max_tokens, n or best_of",
            param="max_tokens",
            code="request_too_large",
        )
    if work.logprobs is None:
        return
    entries = (work.prompts * work.n * max_tokens + work.echo_tokens) * (1 + work.logprobs)
    most = LOGPROB_ENTRIES_PER_TOKEN * limit
    if entries > most:
        raise APIError(
            400,
            f"this request may return {entries} logprob entries (tokens x (1 + "
            f"{work.logprobs} alternatives)); this server returns at most {most} per request: "
            f"lower {work.logprobs_field}, max_tokens or n",
            param=work.logprobs_field,
            code="request_too_large",
        )
