"""Logprobs and prompt logprobs from the engine against transformers' log-softmax (SmolLM2).

The prompt is cached in L1 beforehand, so the prompt logprobs also show that a
request asking for them computes its whole prompt instead of taking the cache.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_reference import hf_logprobs

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams, TokenLogprob
from asynchicache.engine.sampling.logprobs import prompt_targets, token_logprobs
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig

TOP = 5
TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that "
    "passed, the birds that rested on the rail, and the colour of the sea at dusk."
)


def assert_matches(entry: TokenLogprob, ref_row: torch.Tensor, token: int, top: int) -> None:
    """Within 1e-3 of the reference; alternatives in its order (ties within 1e-6 may swap)."""
    assert entry.token_id == token
    assert abs(entry.logprob - ref_row[token].item()) < 1e-3
    assert len(entry.top_ids) == len(entry.top_logprobs) == top
    ref_values, ref_ids = ref_row.topk(top)
    for i, (tid, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs, strict=True)):
        assert abs(lp - ref_row[tid].item()) < 1e-3
        if tid != ref_ids[i].item():  # only a near-tie may swap places
            assert abs(ref_row[tid].item() - ref_values[i].item()) < 1e-6


def test_token_logprobs_are_log_softmax_and_sorted() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 4
    entries = token_logprobs(logits, [1, 2, 3], [0, 2, 5])
    ref = torch.log_softmax(logits, dim=-1)
    assert entries[0].top_ids == () and len(entries[1].top_ids) == 2
    assert list(entries[2].top_ids) == ref[2].topk(5).indices.tolist()
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[i, i + 1].item(), abs=1e-6)


@pytest.mark.parametrize(
    ("start", "num_new", "have", "expected"),
    [
        (0, 10, 0, range(0, 9)),
        (0, 4, 0, range(0, 4)),
        (4, 6, 4, range(0, 5)),
        (0, 10, 6, range(6, 9)),
        (0, 3, 6, range(3, 3)),
        (9, 1, 9, range(0, 0)),
    ],
)
def test_prompt_targets(start: int, num_new: int, have: int, expected: range) -> None:
    assert prompt_targets(10, start, num_new, have) == expected


def test_engine_logprobs_match_transformers(smollm: LoadedModel, hf_smollm: Any) -> None:
    engine = Engine(
        EngineConfig(chunked_prefill_size=16, max_prefill_tokens=16),  # several chunks
        CacheConfig(disk_cache_dir=None, host_cache_gb=0, device_cache_tokens=2048),
        loaded=smollm,
    )
    try:
        prompt = smollm.tokenizer.encode(TEXT)
        warm = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
        assert warm.cached.total == 0
        assert engine.cache.lookup(prompt)["device"] >= len(prompt) - 16  # cached beforehand
        before = engine.computed_prompt_tokens
        params = SamplingParams(
            max_tokens=8, temperature=0, logprobs=TOP, prompt_logprobs=TOP, ignore_eos=True
        )
        out = _collect(engine, prompt, params)
        assert engine.computed_prompt_tokens - before == len(prompt)  # the cache was bypassed
        assert out["cached"] == 0
        generated = out["tokens"]
        ref = hf_logprobs(hf_smollm, prompt + generated)
        assert len(out["prompt_logprobs"]) == len(prompt) - 1
        for j, entry in enumerate(out["prompt_logprobs"]):
            assert_matches(entry, ref[j], prompt[j + 1], TOP)
        assert len(out["logprobs"]) == len(generated) == 8
        for i, entry in enumerate(out["logprobs"]):
            row = ref[len(prompt) - 1 + i]
            assert_matches(entry, row, generated[i], TOP)
            assert generated[i] == int(row.argmax())  # greedy
        assert out["cumulative"] == pytest.approx(sum(e.logprob for e in out["logprobs"]))
        engine.cache.check_integrity()
        assert engine.cache.stats().device.in_use == 0
    finally:
        engine.close()


def test_max_tokens_zero_returns_prompt_logprobs_only(smollm: LoadedModel) -> None:
    engine = Engine(
        EngineConfig(),
        CacheConfig(disk_cache_dir=None, host_cache_gb=0, device_cache_tokens=1024),
        loaded=smollm,
    )
    try:
        prompt = smollm.tokenizer.encode("Paris is the capital of France.")
        out = _collect(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
        assert out["tokens"] == [] and out["reason"] == "length"
        assert len(out["prompt_logprobs"]) == len(prompt) - 1
        assert all(e.top_ids == () for e in out["prompt_logprobs"])
        assert engine.cache.stats().device.in_use == 0
    finally:
        engine.close()


def _collect(engine: Engine, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    from asynchicache.engine.protocol import GenerateRequest

    assert engine.add_request(GenerateRequest("lp", tuple(prompt), params)) is None
    got: dict[str, Any] = {"tokens": [], "logprobs": [], "prompt_logprobs": []}
    while True:
        for out in engine.step():
            got["tokens"] += out.token_ids
            got["logprobs"] += out.logprobs
            got["prompt_logprobs"] += out.prompt_logprobs
            if out.finished:
                got.update(
                    reason=out.finish_reason,
                    cached=out.cached.total,
                    cumulative=out.cumulative_logprob,
                )
                return got
