"""Llama-family model code: config, architectures registry, layers, paged attention.

The names below are imported on first use (PEP 562): the HTTP process reads model
configs and vocabularies from submodules here, and must not import torch for that.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asynchicache.model.attention import AttentionBackend, PagedAttention
    from asynchicache.model.llama import LlamaForCausalLM
    from asynchicache.model.model_config import ModelConfig, RopeConfig, RopeType
    from asynchicache.model.registry import ARCHITECTURES, Architecture, get_architecture

_MODULES = {
    "ARCHITECTURES": "registry",
    "Architecture": "registry",
    "AttentionBackend": "attention",
    "LlamaForCausalLM": "llama",
    "ModelConfig": "model_config",
    "PagedAttention": "attention",
    "RopeConfig": "config",
    "RopeType": "config",
    "get_architecture": "registry",
}

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "AttentionBackend",
    "LlamaForCausalLM",
    "ModelConfig",
    "PagedAttention",
    "RopeConfig",
    "RopeType",
    "get_architecture",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
