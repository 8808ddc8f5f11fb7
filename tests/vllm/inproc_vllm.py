"""vLLM without any KV connector, in the test process: the reference outputs.

A vLLM server is three processes (API server, engine core, worker), each
importing vLLM and torch: ~30 CPU-seconds to start, and memory for a third
server beside the two with our connector. The offline `LLM` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the same engine core and CPU model
runner (same kernels, same greedy sampler) inside this process, which has
imported vLLM already, and starts in a few seconds. Its outputs were checked
equal to a plain `vllm serve`'s on the tiny model (20 of 20 prompts).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def _in_process_engine() -> Iterator[None]:
    """Engine core and worker in this process, only while the engine is built: the
    servers started later copy os.environ and must keep their own processes."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


class PlainVllm:
    """Greedy completions from vLLM without a connector, the flags of `VllmFlags`' servers."""

    def __init__(
        self, model: Path, kv_cache_bytes: int, max_model_len: int = 2048, **engine_args: Any
    ) -> None:
        from vllm import LLM

        with _in_process_engine():
            self.llm = LLM(
                model=str(model),
                enforce_eager=True,
                dtype="float32",
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_bytes,
                **engine_args,  # e.g. speculative_config, enable_lora
            )

    def text(self, tokens: Sequence[int], max_tokens: int = 8, lora: Any = None) -> str:
        """The text vLLM's /v1/completions gives for these prompt token ids (greedy)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        prompt = TokensPrompt(prompt_token_ids=list(tokens))
        (out,) = self.llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        return out.outputs[0].text

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
