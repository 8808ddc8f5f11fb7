"""Rotary position embeddings (the "rotate half" convention of Hugging Face Llama).

Supports plain, linearly scaled and Llama 3 scaled frequencies. cos/sin are
computed per forward for the batch's positions only: cheaper than a table of
`max_position` rows for long-context models, and exact for any position.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from asynchicache.model.model_config import RopeConfig, RopeType


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type is RopeType.LINEAR:
        return inv_freq / rope.factor
    if rope.rope_type is RopeType.LLAMA3:
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a ramp between."""
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for positions and rotates query/key heads."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute `inv_freq` in place (after the model was built on the meta device)."""
        fresh = inverse_frequencies(self.rope, self.head_dim)
        self.inv_freq = fresh.to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] int64 -> cos, sin [T, 1, head_dim // 2] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, hd/2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by cos/sin [T, 1, head_dim // 2]; returns x.

    In place on (views of) the fresh projection output: a long prefill is bound by
    memory traffic here, and this makes one temporary instead of seven.
    """
    x1, x2 = x.chunk(2, dim=-1)  # views [T, heads, hd/2]
    first = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).addcmul_(first, sin)  # x2 cos + x1 sin
    return x
