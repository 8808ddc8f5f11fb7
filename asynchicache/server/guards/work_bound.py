"""How much engine work one HTTP request may ask for (`--max-request-tokens`).

A body of 100 bytes can ask for `prompts x best_of x max_tokens` generated
tokens (each of the `best_of` samples of each prompt runs to `max_tokens` in
the engine; `n <= best_of` only picks which to return), and for logprobs of
every one of them: once 32 x 32 x 1,000 tokens with 20 logprobs each, 462 s of
engine time and a 17 MB answer. And a body of 3 MB can be 64 prompts of 7,000
token ids: issue 39 found one kept the engine busy for over 10 minutes. Three
bounds, each a 400 that names the field:

* prompt tokens: `prompt tokens of all prompts x best_of <= max_request_tokens`
  (`echo` with `max_tokens: 0` computes every prompt token's logprob: counted the
  same). Checked twice: on the text's length before it is tokenized (no token
  stands for more than the vocabulary's longest entry, so the length proves a
  least count: server/guards/bounded_tokenizer.py), then on the exact count;
* all tokens: `prompt tokens x best_of + prompts x best_of x max_tokens <=
  max_request_tokens`. A `max_tokens` the client did not give (chat's "the rest
  of the context") is shrunk to fit instead of refused;
* logprob entries returned: `prompts x n x max_tokens x (1 + logprobs) + echoed
  prompt tokens x (1 + logprobs) <= LOGPROB_ENTRIES_PER_TOKEN x max_request_tokens`.
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
    echo_tokens: int = 0  # prompt tokens whose logprobs are computed (echo, max_tokens 0)
    logprobs_field: str = "logprobs"  # what the client called it (chat: top_logprobs)
    prompt_tokens: int = 0  # of all prompts together
    estimated: bool = False  # the counts are least counts, from the text before tokenizing

    @property
    def prompt_work(self) -> int:
        """Prompt tokens to compute: every sample of a prompt is its own request."""
        return self.prompt_tokens * self.best_of


def fit_default(limit: int, work: Work, default: int) -> int:
    """A defaulted `max_tokens` shrunk so that the request fits the bound (at least 1)."""
    room = max(0, limit - work.prompt_work)
    return max(1, min(default, room // (work.prompts * work.best_of)))


def check_work(limit: int, work: Work, max_tokens: int) -> None:
    """400 when `work` with `max_tokens` per sample passes any bound."""
    least = "at least " if work.estimated else ""
    if work.prompt_work > limit:
        raise APIError(
            400,
            f"this request has {least}{work.prompt_work} prompt tokens to compute "
            f"({work.prompts} prompt(s) of {least}{work.prompt_tokens} tokens in all x "
            f"best_of {work.best_of}); this server allows {limit} per request "
            "(--max-request-tokens): send fewer or shorter prompts, or lower best_of",
            param="prompt",
            code="request_too_large",
        )
    generated = work.prompts * work.best_of * max_tokens
    if generated + work.prompt_work > limit:
        raise APIError(
            400,
            f"this request may generate {generated} tokens ({work.prompts} prompt(s) x "
            f"best_of {work.best_of} x max_tokens {max_tokens}) after {least}"
            f"{work.prompt_work} prompt tokens; this server allows {limit} per request "
            "(--max-request-tokens): lower max_tokens, n or best_of",
            param="max_tokens",
            code="request_too_large",
        )
    _check_logprobs(limit, work, max_tokens)


def _check_logprobs(limit: int, work: Work, max_tokens: int) -> None:
    alternatives = work.logprobs or 0
    entries = work.echo_tokens * (1 + alternatives)
    if work.logprobs is not None:
        entries += work.prompts * work.n * max_tokens * (1 + alternatives)
    most = LOGPROB_ENTRIES_PER_TOKEN * limit
    if entries > most:
        raise APIError(
            400,
            f"this request may return {entries} logprob entries (tokens x (1 + "
            f"{alternatives} alternatives)); this server returns at most {most} per request: "
            f"lower {work.logprobs_field}, max_tokens or n",
            param=work.logprobs_field,
            code="request_too_large",
        )
