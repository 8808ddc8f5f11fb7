"""Penalties and biases on the logits before a token is chosen (OpenAI and vLLM semantics).

* `logit_bias`: added to the listed tokens' logits.
* `presence_penalty`: subtracted once from every token the request has generated.
* `frequency_penalty`: subtracted once per time the token was generated.
* `repetition_penalty` (the CTRL / Hugging Face rule, as vLLM applies it): the
  logit of every token seen in the prompt or the output is divided by it when
  positive and multiplied by it when negative.

They change what is sampled (greedy included), never the logprobs reported,
which come from the raw distribution. A penalized logit that leaves the float
range (a large penalty on a large logit) is clamped to it, and a NaN becomes
-inf, so greedy and sampling always find a token (`sampler.finite_logits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asynchicache.engine.protocol import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> torch.Tensor:
    """logits [n, vocab] -> a penalized copy (or `logits` itself when no row asks).

    histories[i] = (prompt, output so far) of row i.
    """
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    out = logits.float().clone()  # [n, vocab]
    for i in rows:
        prompt, output = histories[i]
        out[i] = _penalize(out[i], params[i], prompt, output)
    big = torch.finfo(out.dtype).max
    return torch.nan_to_num(out, nan=float("-inf"), posinf=big)


def _penalize(
    row: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """row [vocab] float32 -> penalized row."""
    vocab = row.shape[0]
    device = row.device
    if p.logit_bias:
        ids = torch.tensor([b.token_id for b in p.logit_bias], device=device)
        bias = torch.tensor([b.bias for b in p.logit_bias], device=device)
        row = row.index_add(0, ids, bias)
    out_ids = torch.tensor(list(output), dtype=torch.long, device=device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        seen[out_ids] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, scaled, row)
    if (p.presence_penalty or p.frequency_penalty) and len(output):
        counts = torch.bincount(out_ids, minlength=vocab).to(row.dtype)  # [vocab]
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    return row
