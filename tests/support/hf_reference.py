"""Hugging Face transformers as the reference our models are checked against.

The same weights (an HF folder or a GGUF file) loaded by transformers in
float32; what it computes is what ours must match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_model(path: Path) -> Any:
    """transformers' model of `path` (a GGUF file or an HF checkpoint folder), in eval mode."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits at every position of one forward over `tokens`."""
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_logprobs(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] log-softmax of `hf_logits`."""
    return torch.log_softmax(hf_logits(hf, tokens), dim=-1)
