"""Llama-family model code: config, architectures registry, layers, paged attention.

The names below are imported on first use (asynchicache.common.faces): the HTTP process
reads model configs and vocabularies from submodules here, and must not import torch for
that.
"""

from __future__ import annotations

from asynchicache.common.faces import lazy_face

__all__, __getattr__ = lazy_face(
    __name__,
    {
        "ARCHITECTURES": "registry",
        "Architecture": "registry",
        "AttentionBackend": "attention",
        "LlamaForCausalLM": "llama",
        "ModelConfig": "model_config",
        "PagedAttention": "attention",
        "RopeConfig": "model_config",
        "RopeType": "model_config",
        "get_architecture": "registry",
    },
)
