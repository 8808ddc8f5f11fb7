"""The memory-pressure workload of `bench pressure`: shuffled repeats over a prefix set.

A set of prefixes whose KV takes `working_set` times the device tier (L1, and
the KV memory every vLLM arm gets), each ~`prefix_tokens` tokens of English-like
text, is asked `repeats` times with a different short suffix each time; the
requests are shuffled, as vLLM's prefix-repetition dataset shuffles its
prompts. So L1 alone (or vLLM's own prefix cache) cannot keep every prefix
between two of its uses, and a tier below it can.

Prompts are token ids (`/v1/completions` with a list of ids: both servers take
them as they are, so every server sees exactly the same tokens and no chat
template or retokenization stands between them). Deterministic with `seed`.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from asynchicache.bench.workloads import text
from asynchicache.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class PressureParams:
    """The workload's shape (flags of `bench pressure` of the same names)."""

    l1_tokens: int = 16384  # device KV of every arm, in tokens
    working_set: float = 2.5  # the prefix set's tokens / l1_tokens
    prefix_tokens: int = 1000
    suffix_tokens: int = 32
    repeats: int = 4  # requests per prefix
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("l1_tokens", "prefix_tokens", "suffix_tokens", "repeats", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.working_set <= 0:
            raise ValueError("--working-set must be positive")

    @property
    def num_prefixes(self) -> int:
        return max(1, math.ceil(self.working_set * self.l1_tokens / self.prefix_tokens))


@dataclass(frozen=True)
class PressureRequest:
    prefix: int  # which prefix of the set
    prompt: tuple[int, ...]  # token ids: the prefix's, then the suffix's


@dataclass(frozen=True)
class PressureWorkload:
    params: PressureParams
    requests: tuple[PressureRequest, ...]

    @property
    def working_set_tokens(self) -> int:
        return self.params.num_prefixes * self.params.prefix_tokens

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self.params),
            "num_prefixes": self.params.num_prefixes,
            "requests": len(self.requests),
            "working_set_tokens": self.working_set_tokens,
            "prompt_tokens": sum(len(r.prompt) for r in self.requests),
        }


def _ids(tokenizer: Tokenizer, words: str, n: int) -> list[int]:
    ids = tokenizer.encode(words, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"generated text gave {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def build(params: PressureParams, tokenizer: Tokenizer) -> PressureWorkload:
    """Every request of the run, in the order the clients send them."""
    rng = random.Random(params.seed)
    requests: list[PressureRequest] = []
    for p in range(params.num_prefixes):
        # 1.5x the aim in words: the cut to exact token counts never runs short.
        words = text.text(rng, params.prefix_tokens * 3 // 2)
        prefix = _ids(tokenizer, words, params.prefix_tokens)
        for _ in range(params.repeats):
            q = text.question(rng, params.suffix_tokens * 3 // 2 + 8)
            # Numbered: even a short cut of two suffixes never gives the same prompt.
            suffix = _ids(tokenizer, f" Question {len(requests) + 1}: {q}", params.suffix_tokens)
            requests.append(PressureRequest(p, tuple(prefix + suffix)))
    rng.shuffle(requests)
    return PressureWorkload(params, tuple(requests))


def warm_up_prompt(params: PressureParams, tokenizer: Tokenizer) -> list[int]:
    """A prompt of the run's shape that no request of the run shares a page with."""
    rng = random.Random(params.seed + 7919)
    words = text.text(rng, params.prefix_tokens * 3 // 2)
    return _ids(tokenizer, words, params.prefix_tokens + params.suffix_tokens)
