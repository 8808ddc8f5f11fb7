"""Choosing the next token per request (stopping is the engine's `_stop_reason`).

`sample` handles a batch whose rows have different settings: greedy rows take
the argmax, the others are tempered, min-p, top-k and top-p filtered (vectorized
over the batch) and drawn with their request's own `torch.Generator`, so a
seeded request gives the same tokens whatever else is in the batch. `pick` adds
what a request may ask beyond that: penalties and biases before sampling, and
the chosen token's logprob (from the raw logits) after.

Total over what `SamplingParams` accepts: no setting makes a step raise. Every
filter keeps the most likely token; a logit that overflowed (a tiny temperature,
a huge penalty) counts as the largest float and a NaN as impossible; a row with
no finite logit left falls back to its argmax. For finite logits and ordinary
settings these guards change nothing: greedy stays the argmax, and the
probabilities are the same numbers as without them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asynchicache.engine.protocol import SamplingParams, TokenLogprob
from asynchicache.engine.sampling.logprobs import token_logprobs
from asynchicache.engine.sampling.penalties import apply_penalties


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
    tokens = logits.argmax(dim=-1)  # [n]; a NaN row still gives an index in range
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


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float logits with NaN -> -inf (never drawn) and +inf -> the largest float (its
    token first); finite values and -inf pass unchanged."""
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[m, vocab] logits -> probabilities after temperature, min-p, top-k and top-p.

    Every filter keeps the best token (rank 0), so no row ends empty.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    scaled = _tempered(logits.float(), temperature)  # [m, vocab]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [m, vocab]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=device)[None, :]  # [1, vocab]
    if any(p.min_p for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        # p_i >= min_p * p_0  <=>  logit_i >= logit_0 + log(min_p) (min_p 0: -inf, keeps all)
        floor = sorted_logits[:, :1] + min_p.log()
        sorted_logits = sorted_logits.masked_fill((sorted_logits < floor) & (ranks > 0), -math.inf)
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill((ranks >= top_k) & (ranks > 0), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    # Keep a token when the mass strictly before it is below top_p; the first always
    # stays (a top_p below float32's smallest number reads as 0 here).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill((mass_before >= top_p) & (ranks > 0), 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return _argmax_where_broken(probs, scaled)


def _tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [m, vocab] / temperature [m, 1]. A row that is not finite then (a logit
    overflowed, or was not finite to begin with) is shifted by its max first, so its
    best token stays the best and the rest fall to -inf rather than to NaN."""
    scaled = logits / temperature
    ok = torch.isfinite(scaled).all(dim=-1)  # [m]
    if bool(ok.all()):
        return scaled  # the usual case, untouched
    x = finite_logits(logits)
    shifted = finite_logits((x - x.max(dim=-1, keepdim=True).values) / temperature)
    return torch.where(ok[:, None], scaled, shifted)


def _argmax_where_broken(probs: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Rows that are no distribution (no finite logit was left: all -inf, or all NaN)
    become one-hot on their argmax, so `torch.multinomial` always has something to draw."""
    broken = ~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)  # [m]
    if not bool(broken.any()):
        return probs
    one_hot = torch.zeros_like(probs).scatter_(-1, scaled.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(broken[:, None], one_hot, probs)
