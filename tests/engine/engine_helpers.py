"""Helpers shared by the engine tests (imported as a plain module)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from asynchicache.model.loader import LoadedModel
from asynchicache.model.runner import ForwardBatch, ModelRunner


def make_pool(model: LoadedModel, num_pages: int, page_size: int) -> torch.Tensor:
    c = model.config
    dtype = model.model.embed_tokens.weight.dtype
    # [pages, layers, 2, page_size, kv_heads, head_dim]
    return torch.zeros(
        num_pages, c.num_layers, 2, page_size, c.num_kv_heads, c.head_dim, dtype=dtype
    )


def greedy_generate(
    runner: ModelRunner,
    prompt: list[int],
    page_table: list[int],
    steps: int,
    stop: Callable[[int], bool] = lambda _: False,
) -> list[int]:
    """Prefill `prompt` in one go, then decode greedily for `steps` tokens."""
    logits = runner.forward(ForwardBatch([prompt], [0], [page_table]))
    out: list[int] = []
    for _ in range(steps):
        token = int(logits[0].argmax())
        out.append(token)
        if stop(token):
            break
        start = len(prompt) + len(out) - 1
        logits = runner.forward(ForwardBatch([[token]], [start], [page_table]))
    return out
