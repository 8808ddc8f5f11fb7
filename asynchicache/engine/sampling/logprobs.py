"""Token log-probabilities from the raw model distribution.

What a client asks for with `logprobs` is the model's own belief: the
log-softmax of the logits in float32, before temperature, penalties, biases and
top-k/top-p change the distribution that is sampled from (vLLM's default,
"raw_logprobs"). A request that asks for prompt logprobs collects one entry per
prompt token after the first while its prompt is computed; the runner returns
the logits of every prompt position for it (`ForwardBatch.every_position`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asynchicache.engine.protocol import TokenLogprob

# What an impossible token's logprob reads (vLLM and OpenAI report -9999.0 too).
LOGPROB_FLOOR = -9999.0


def token_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], top: Sequence[int]
) -> list[TokenLogprob]:
    """logits [n, vocab] -> per row: chosen[i]'s logprob and the top[i] best alternatives."""
    if not (logits.shape[0] == len(chosen) == len(top)):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(chosen)} tokens, {len(top)} tops")
    if not chosen:
        return []
    # A -inf or NaN logprob (non-finite logits) is reported as LOGPROB_FLOOR: JSON has no
    # infinities, and a client's sum of logprobs must stay a number.
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    logp = torch.nan_to_num(logp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0)
    ids = torch.tensor(chosen, device=logp.device)[:, None]
    picked = logp.gather(1, ids)[:, 0].tolist()  # [n]
    k = max(top)
    top_lp: list[list[float]] = [[] for _ in chosen]
    top_ids: list[list[int]] = [[] for _ in chosen]
    if k:
        values, indices = logp.topk(k, dim=-1)  # [n, k], most likely first
        top_lp, top_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprob(int(tok), float(lp), tuple(top_ids[i][: top[i]]), tuple(top_lp[i][: top[i]]))
        for i, (tok, lp) in enumerate(zip(chosen, picked, strict=True))
    ]


def prompt_targets(prompt_len: int, start: int, num_new: int, have: int) -> range:
    """Which of a chunk's rows give prompt logprobs not collected yet.

    The chunk fed positions [start, start + num_new); the row at position p
    predicts prompt token p + 1. `have` entries (prompt tokens 1..have) exist
    already (a preempted request recomputes its prompt). Returns the rows'
    offsets within the chunk.
    """
    first = max(start, have)  # position whose row predicts token have + 1
    last = min(start + num_new, prompt_len - 1)  # exclusive: token prompt_len is no prompt
    return range(first - start, max(first, last) - start)


def collect_prompt_logprobs(
    collected: list[TokenLogprob],
    prompt: Sequence[int],
    rows: torch.Tensor,
    start: int,
    top: int,
) -> None:
    """Append the prompt logprobs that `rows` [num_new, vocab] (a chunk at `start`) give."""
    offsets = prompt_targets(len(prompt), start, rows.shape[0], len(collected))
    if not offsets:
        return
    picked = rows[offsets.start : offsets.stop]
    targets = [prompt[start + o + 1] for o in offsets]
    collected += token_logprobs(picked, targets, [top] * len(targets))
