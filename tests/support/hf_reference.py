"""Hugging Face transformers as the reference our models are checked against.

The same weights (an HF folder or a GGUF file) loaded by transformers in
float32; what it computes is what ours must match.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def hf_model(path: Path) -> Any:
    """transformers' model of `path` (a GGUF file or an HF checkpoint folder), in eval mode."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        with _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers (5.x) parses a GGUF file twice, for the config and for the weights
    (gguf-py's `GGUFReader` reads every field: SmolLM2's 49k-token vocabulary), and builds
    gguf-py's tensor-name map anew for each of its ~400 modules: 13 of the 21 CPU-s that
    loading the default model took here. Both are pure reads of one file, so while one
    model loads each is made once; what transformers dequantizes and maps is unchanged
    (the logits are the same, bit for bit)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)  # type: ignore[misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits at every position of one forward over `tokens`."""
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_logprobs(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] log-softmax of `hf_logits`."""
    return torch.log_softmax(hf_logits(hf, tokens), dim=-1)
