"""Architectures we can run, registered by name.

Every entry is a Llama-family decoder; entries differ in which biases and norms
their attention has. Hugging Face names (`config.json` "architectures") and GGUF
names (`general.architecture`) both resolve here; an unknown name raises an
error that lists the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from asynchicache.model.model_config import (
    ModelConfig,
    eos_ids_from,
    rope_from_hf,
    sliding_windows_from_hf,
)

if TYPE_CHECKING:  # torch: the HTTP process reads configs here without it
    from asynchicache.model.llama import LlamaForCausalLM


class BiasRule(Enum):
    NONE = auto()  # no projection has a bias (Mistral)
    QKV = auto()  # q, k, v have biases, o has none (Qwen2)
    FROM_CONFIG = auto()  # `attention_bias` decides for q, k, v and o (Llama, Qwen3)


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one Llama-family architecture from another."""

    name: str
    bias: BiasRule
    qk_norm: bool = False
    # llama.cpp stores Llama's Q/K rows interleaved for its rotary kernel.
    gguf_permute_qk: bool = False

    @property
    def model_class(self) -> type[LlamaForCausalLM]:
        """The module that runs it (every entry is a Llama-family decoder)."""
        from asynchicache.model.llama import LlamaForCausalLM

        return LlamaForCausalLM

    def model_config(self, cfg: dict[str, Any]) -> ModelConfig:
        """A ModelConfig from a Hugging Face config.json dict."""
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        attention_bias = bool(cfg.get("attention_bias", False))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{self.name}: hidden_act {act!r} is not supported (only 'silu')")
        return ModelConfig(
            arch=self.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(cfg),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=self.bias is BiasRule.QKV
            or (self.bias is BiasRule.FROM_CONFIG and attention_bias),
            o_bias=self.bias is BiasRule.FROM_CONFIG and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=self.qk_norm,
            sliding_windows=sliding_windows_from_hf(cfg, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids_from(cfg.get("eos_token_id")),
        )


ARCHITECTURES: MappingProxyType[str, Architecture] = MappingProxyType(
    {
        a.name: a
        for a in (
            Architecture("LlamaForCausalLM", BiasRule.FROM_CONFIG, gguf_permute_qk=True),
            Architecture("MistralForCausalLM", BiasRule.NONE, gguf_permute_qk=True),
            Architecture("Qwen2ForCausalLM", BiasRule.QKV),
            Architecture("Qwen3ForCausalLM", BiasRule.FROM_CONFIG, qk_norm=True),
        )
    }
)

# GGUF's general.architecture -> our name (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES: MappingProxyType[str, str] = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
)


def get_architecture(name: str) -> Architecture:
    """The registered architecture called `name` (HF or GGUF spelling)."""
    name = GGUF_ARCHITECTURES.get(name, name)
    arch = ARCHITECTURES.get(name)
    if arch is None:
        known = ", ".join([*ARCHITECTURES, *(f"{k} (GGUF)" for k in GGUF_ARCHITECTURES)])
        raise ValueError(f"unknown model architecture {name!r}; known: {known}")
    return arch
