"""The model's shape and rotary settings, as one frozen, validated dataclass.

Built from a Hugging Face `config.json` (both the transformers 4 layout with
`rope_theta` + `rope_scaling` and the transformers 5 layout with
`rope_parameters`) or from GGUF metadata (see `engine.models.gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class RopeType(StrEnum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; the extra fields matter only for their `rope_type`."""

    theta: float = 10000.0
    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # GGUF (llama.cpp) spelling of Llama 3 scaling: one divisor per frequency.
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be positive, got {self.factor}")
        if not isinstance(self.rope_type, RopeType):
            object.__setattr__(self, "rope_type", _rope_type(str(self.rope_type)))


def _rope_type(name: str) -> RopeType:
    try:
        return RopeType(name)
    except ValueError:
        known = ", ".join(t.value for t in RopeType)
        raise ValueError(f"unsupported rope_type {name!r}; known: {known}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the KV pool need to know about a checkpoint."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: the attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Rotary settings from either config.json layout (transformers 4 or 5)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=float(theta),
        rope_type=_rope_type(str(rope_type or "default")),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def eos_ids_from(*values: Any) -> tuple[int, ...]:
    """Union of eos ids given as ints, lists or None, in first-seen order."""
    ids: list[int] = []
    for value in values:
        items = value if isinstance(value, list | tuple) else [value]
        ids += [int(v) for v in items if v is not None and int(v) not in ids]
    return tuple(ids)


def sliding_windows_from_hf(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows: Mistral windows every layer; Qwen only with use_sliding_window."""
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
