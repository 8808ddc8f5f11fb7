"""Choosing the next token per request (stopping is the engine's `_stop_reason`).

`sample` handles a batch whose rows have different settings: greedy rows take
the argmax, the others are tempered, top-k and top-p filtered (vectorized over
the batch) and drawn with their request's own `torch.Generator`, so a seeded
request gives the same tokens whatever else is in the batch. `pick` adds what a
request may ask beyond that: penalties and biases before sampling, and the
chosen token's logprob (from the raw logits) after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asynchicache.engine.logprobs import token_logprobs
from asynchicache.engine.penalties import apply_penalties
from asynchicache.engine.protocol import SamplingParams, TokenLogprob


def request_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A per-request generator: seeded when asked, otherwise from OS entropy.

    (An unseeded `torch.Generator` starts from a fixed default seed, which would
    make every unseeded request draw the same numbers.)
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """logits [n, vocab] float -> one token id per row.

    A row whose generator is None draws from torch's global generator.
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample: {logits.shape[0]} logit rows, {len(params)} params, "
            f"{len(generators)} generators"
        )
    tokens = logits.argmax(dim=-1)  # [n]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, rows), [params[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            drawn = torch.multinomial(probs[j], 1, generator=generators[i])
            tokens[i] = drawn[0]
    return tokens.tolist()


@dataclass(frozen=True)
class Pick:
    """The chosen token, and its raw logprob when the request asked (or None)."""

    token: int
    logprob: TokenLogprob | None = None


def pick(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> list[Pick]:
    """Raw logits [n, vocab] -> one token per row, penalized as each row asks,
    with its logprob for rows whose `logprobs` is set. histories[i] = (prompt, output)."""
    tokens = sample(apply_penalties(logits, params, histories), params, generators)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    found: dict[int, TokenLogprob] = {}
    if asking:
        rows = logits.index_select(0, torch.tensor(asking, device=logits.device))
        entries = token_logprobs(
            rows, [tokens[i] for i in asking], [params[i].logprobs or 0 for i in asking]
        )
        found = dict(zip(asking, entries, strict=True))
    return [Pick(tok, found.get(i)) for i, tok in enumerate(tokens)]


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[m, vocab] logits -> probabilities after temperature, top-k and top-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    scaled = logits.float() / temperature  # [m, vocab]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [m, vocab]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)[:, None]
    ranks = torch.arange(vocab, device=device)[None, :]  # [1, vocab]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    # Keep a token when the mass strictly before it is below top_p (the first always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
