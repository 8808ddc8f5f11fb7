"""Llama-family model code: config, architectures registry, layers, paged attention."""

from asynchicache.engine.models.attention import AttentionBackend, PagedAttention
from asynchicache.engine.models.config import ModelConfig, RopeConfig, RopeType
from asynchicache.engine.models.llama import LlamaForCausalLM
from asynchicache.engine.models.registry import ARCHITECTURES, Architecture, get_architecture

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
