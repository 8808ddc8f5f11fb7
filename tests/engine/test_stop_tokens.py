"""Where generation stops: `ignore_eos` skips the model's end-of-sequence ids only.

As in vLLM, a request's own `stop_token_ids` still end it when `ignore_eos` is
set (failed on 697821a: ignore_eos skipped both).
"""

from __future__ import annotations

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig

PROMPT = [5, 17, 33, 2, 41, 8, 19, 23, 7]


def _engine(model: LoadedModel) -> Engine:
    return Engine(EngineConfig(), CacheConfig(disk_cache_dir=None), loaded=model)


def test_stop_token_ids_end_a_request_that_ignores_eos(tiny_llama: LoadedModel) -> None:
    engine = _engine(tiny_llama)
    try:
        free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        (full,) = engine.generate([PROMPT], free)
        assert len(full.token_ids) == 8 and full.finish_reason == "length"
        stop_at = full.token_ids[3]
        first = full.token_ids.index(stop_at)  # the first time greedy decoding emits it
        stopping = SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,)
        )
        (out,) = engine.generate([PROMPT], stopping)
        assert out.token_ids == full.token_ids[: first + 1]
        assert out.finish_reason == "stop"
    finally:
        engine.close()


def test_ignore_eos_still_skips_the_models_eos(tiny_llama: LoadedModel) -> None:
    engine = _engine(tiny_llama)
    try:
        free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        (full,) = engine.generate([PROMPT], free)
        engine.eos_ids = frozenset({full.token_ids[1]})  # the model "ends" at its 2nd token
        (out,) = engine.generate([PROMPT], free)
        assert out.token_ids == full.token_ids and out.finish_reason == "length"
        (plain,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0))
        assert plain.finish_reason == "stop"
        assert plain.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[1]) + 1]
    finally:
        engine.close()
