"""A 2-layer random Llama with SmolLM2's tokenizer (head_dim 32, as vLLM's CPU attention
needs), for tests that run a real vLLM: tests/vllm's `tiny_hf`, tests/fleet's vLLM
instances. Built, never downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def tiny_llama(folder: Path, smollm_hf: Path) -> Path:
    """The model in `folder` (seeded: the same weights every time); `smollm_hf` is the
    embedded SmolLM2 as an HF folder (`export_hf`), whose tokenizer it takes."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **TINY)
    gen = torch.Generator().manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise)
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm_hf / name, folder / name)
    return folder
