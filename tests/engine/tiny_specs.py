"""The tiny random architectures the engine tests build (tests/engine/conftest.py writes
them as Hugging Face folders; test_models.py names its cases after them). A module of its
own, imported by name: `from conftest import` found whichever folder's conftest.py a run
loaded last (a run of tests/engine with tests/cache failed to collect)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@dataclass(frozen=True)
class TinySpec:
    """One tiny architecture to build: a transformers config class and its extras."""

    config_class: str
    extra: dict[str, Any]


TINY_SPECS = {
    "llama3-rope-tied": TinySpec(
        "LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}
    ),
    "llama-untied-bias": TinySpec(
        "LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}
    ),
    "mistral-window": TinySpec(
        "MistralConfig", {"sliding_window": 16, "tie_word_embeddings": False}
    ),
    "qwen2": TinySpec("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": TinySpec("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
}
