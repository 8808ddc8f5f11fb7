"""How vLLM's paged KV tensors hold K and V (`BlockFormat`), and their tiled views (`TiledKV`).

Our page is `[layers, 2, page_size, kv_heads, head_dim]` (cache.pools.KVLayout),
so a vLLM block of `block_size` tokens is `block_size // page_size` of our pages.
vLLM hands `register_kv_caches` one tensor per attention layer; what its
dimensions mean depends on the attention backend (vLLM 0.32) and, for the CPU
backend, on the kernel (ISA) it picked:

* CPU_ATTN with kernels vec and vec16: `[blocks, kv_heads, block_size, 2 * head_dim]`;
  the memory of one (block, head) is K transposed, `[head_dim, block_size]`, then
  V, `[block_size, head_dim]` ("head-major, K transposed"): where its kernel
  `cpu_attn_reshape_and_cache` writes token t's K[d] and V[d]
  (tests/vllm/test_cpu_kernel_layout.py checks it against the kernel). So K of a
  16-token page is spread over the whole block: only a view that knows this
  copies a part of a block right.
* CPU_ATTN with kernel amx (the default on AMX hosts for bfloat16 models): the
  same tensor shape and the same K-then-V halves per (block, head), each packed
  for AMX tiles (64-byte rows) in 4-byte pairs of 2-byte elements: K as
  `[block_size / 16, head_dim / 2, 16 tokens, 2 dims]` (a token's dims in pairs,
  16 tokens side by side), V as `[head_dim / 16, block_size / 2, 16 dims, 2 tokens]`
  (pairs of consecutive tokens, 16 dims side by side); found in its
  `reshape_and_cache` and checked against the kernel on AMX hosts.
* FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION: the same 4D shape, but each token's
  row is `[K | V]` along the last dimension ("token-interleaved"); the strides
  follow VLLM_KV_CACHE_LAYOUT (LBNHC is the classic NHD memory order).
* Older vLLM's FlashAttention: `[2, blocks, block_size, kv_heads, head_dim]`
  ("kv-first"), recognised from the 5D shape.

Every format is turned into two tiled strided views per layer, K and V
(`TiledKV`), over the same memory (no copy): `[blocks, block_size / a, a,
kv_heads, head_dim / b, b]`, the tokens in tiles of `a` and each head's dims in
tiles of `b` (a = b = 1 but for amx), so a page of ours, `[page_size, kv_heads,
head_dim]`, unflattened the same way, is copied in one strided copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

import torch


class BlockFormat(StrEnum):
    HEAD_MAJOR_SPLIT = "head_major_kt"  # K transposed, then V, per (block, head)
    HEAD_MAJOR_AMX = "head_major_amx"  # K, then V, per (block, head), packed for AMX tiles
    TOKEN_INTERLEAVED = "token_interleaved"
    KV_FIRST = "kv_first"


# Attention backend (CPU_ATTN with the kernel it picked, as numerics.qualified_backend
# names it) -> how its 4D `[blocks, kv_heads, block_size, 2 * head_dim]` per-layer tensor
# holds K and V (read from vLLM 0.32's backends and CPU kernels). Other CPU kernels
# (neon, vsx, vxe, rvv) are refused at start rather than copied wrong.
BACKEND_FORMATS: MappingProxyType[str, BlockFormat] = MappingProxyType(
    {
        "CPU_ATTN:vec": BlockFormat.HEAD_MAJOR_SPLIT,
        "CPU_ATTN:vec16": BlockFormat.HEAD_MAJOR_SPLIT,
        "CPU_ATTN:amx": BlockFormat.HEAD_MAJOR_AMX,
        "FLASH_ATTN": BlockFormat.TOKEN_INTERLEAVED,
        "TRITON_ATTN": BlockFormat.TOKEN_INTERLEAVED,
        "FLEX_ATTENTION": BlockFormat.TOKEN_INTERLEAVED,
    }
)

# The amx kernel's packing: 64-byte tile rows of 4-byte pairs of 2-byte elements.
_AMX_ITEMSIZE = 2
_AMX_PAIR = 4 // _AMX_ITEMSIZE  # elements per 4-byte pair
_AMX_COLUMNS = 16  # 4-byte pairs per 64-byte tile row


@dataclass(frozen=True)
class BlockGeometry:
    """What vLLM's KV cache spec says about one layer's tensor."""

    num_blocks: int  # manager blocks (KVCacheConfig.num_blocks)
    block_size: int  # tokens per manager block
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class TiledKV:
    """K or V of one layer as `[blocks, block_size / a, a, kv_heads, head_dim / b, b]`
    (a strided view of vLLM's tensor): token `t` is tile `t // a`, row `t % a`; dim `d`
    is tile `d // b`, column `d % b`. Any `[..., tokens, kv_heads, head_dim]` tensor
    `tile`d the same way lines up with it element for element.

    `blocks` may hold the elements packed: `dtype` is theirs, `blocks.dtype` a wider one
    (amx's K, whose bfloat16 dims travel in pairs as int32: a copy of 4-byte elements
    runs ~10x faster than of the same bytes as 2-byte ones split in a dimension of 2);
    `head_dim` then counts `dtype` elements and `tile` packs a tensor the same way."""

    blocks: torch.Tensor
    a: int = 1
    b: int = 1
    dtype: torch.dtype | None = None  # the elements' dtype; None: blocks.dtype

    @property
    def element_dtype(self) -> torch.dtype:
        return self.blocks.dtype if self.dtype is None else self.dtype

    @property
    def pack(self) -> int:
        """Elements per element of `blocks` (1: not packed)."""
        return self.blocks.element_size() // self.element_dtype.itemsize

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def block_size(self) -> int:
        return self.blocks.shape[1] * self.a

    @property
    def num_kv_heads(self) -> int:
        return self.blocks.shape[3]

    @property
    def head_dim(self) -> int:
        return self.blocks.shape[4] * self.b * self.pack

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., T, H, D]` -> `[..., T / a, a, H, D / b, b]` (a view; packed as `blocks`)."""
        if x.dtype != self.blocks.dtype:
            x = x.view(self.blocks.dtype)  # pairs of dims as one element (last dim dense)
        return x.unflatten(-3, (-1, self.a)).unflatten(-1, (-1, self.b))

    def untile(self, x: torch.Tensor) -> torch.Tensor:
        """A tiled `[..., T / a, a, H, D / b, b]` -> `[..., T, H, D]` of `element_dtype`
        (a copy when tiled)."""
        flat = x.flatten(-2).flatten(-4, -3)
        return flat.contiguous().view(self.element_dtype) if self.pack > 1 else flat

    def pages(self, page_size: int) -> torch.Tensor:
        """`[blocks, pages per block, P / a, a, H, D / b, b]` (a view)."""
        return self.blocks.unflatten(1, (-1, page_size // self.a))

    def tokens(self, block: int, start: int, stop: int) -> torch.Tensor:
        """Tokens `start .. stop - 1` of `block` (multiples of `a`), tiled (a view)."""
        return self.blocks[block, start // self.a : stop // self.a]

    def logical(self) -> torch.Tensor:
        """`[blocks, block_size, kv_heads, head_dim]`: a view when untiled, else a copy."""
        return self.untile(self.blocks)


def detect_format(backend: str, shape: Sequence[int], geometry: BlockGeometry) -> BlockFormat:
    """The format of a layer tensor of `shape` under attention backend `backend`."""
    h, d = geometry.num_kv_heads, geometry.head_dim
    if len(shape) == 5 and shape[0] == 2 and tuple(shape[3:]) == (h, d):
        return BlockFormat.KV_FIRST
    if len(shape) == 4 and shape[1] == h and shape[3] == 2 * d:
        fmt = BACKEND_FORMATS.get(backend)
        if fmt is None:
            raise ValueError(
                f"attention backend {backend!r} is not supported by AsynchicacheConnector; "
                f"known: {', '.join(BACKEND_FORMATS)}"
            )
        return fmt
    raise ValueError(
        f"unexpected KV cache tensor shape {tuple(shape)} for {backend} with {h} KV heads "
        f"of {d}: expected [blocks, {h}, block_size, {2 * d}] or [2, blocks, block_size, {h}, {d}]"
    )


def tiled_kv(tensor: torch.Tensor, fmt: BlockFormat) -> tuple[TiledKV, TiledKV]:
    """K and V of one layer tensor, tiled as its format lays them out, sharing its memory."""
    if fmt is not BlockFormat.HEAD_MAJOR_AMX:
        k, v = canonical_kv(tensor, fmt)
        return TiledKV(k.unflatten(1, (-1, 1)).unflatten(-1, (-1, 1))), TiledKV(
            v.unflatten(1, (-1, 1)).unflatten(-1, (-1, 1))
        )
    blocks, heads, tokens, width = tensor.shape
    head_dim = width // 2
    if tensor.element_size() != _AMX_ITEMSIZE:
        raise ValueError(
            f"the amx CPU attention kernel's block layout is known for 2-byte KV "
            f"(bfloat16), not {tensor.dtype}"
        )
    if tensor.stride(3) != 1 or tensor.stride(2) != width:
        raise ValueError(f"a head-major KV block must be dense per head; strides {tensor.stride()}")
    group = _AMX_COLUMNS  # K: 16 tokens side by side per tile row
    if tokens % (group * _AMX_PAIR) or head_dim % (group * _AMX_PAIR):
        raise ValueError(
            f"the amx kernel packs blocks of a multiple of {group * _AMX_PAIR} tokens and "
            f"heads of a multiple of {group * _AMX_PAIR} dims; got {tokens} and {head_dim}"
        )
    s_block, s_head, pair = tensor.stride(0), tensor.stride(1), _AMX_PAIR
    # K per (block, head): [N / 16 token groups, D / 2 dim pairs, 16 tokens, 2 dims]; each
    # token's pair of dims is 4 contiguous bytes in vLLM's block and in our page alike,
    # so K is copied as int32 pairs: [N / 16, D / 2, 16] per (block, head)
    packed = tensor.view(torch.int32)  # [B, H, N, D] pairs
    k = packed.as_strided(
        (blocks, tokens // group, group, heads, head_dim // pair, 1),
        (s_block // pair, group * head_dim // pair, 1, s_head // pair, group, 1),
    )
    # V per (block, head): [D / 16 dim groups, N / 2 token pairs, 16 dims, 2 tokens]
    v = tensor.as_strided(
        (blocks, tokens // pair, pair, heads, head_dim // group, group),
        (s_block, group * pair, 1, s_head, tokens * group, pair),
        tensor.storage_offset() + tokens * head_dim,
    )
    return TiledKV(k, group, 1, tensor.dtype), TiledKV(v, pair, group)


def canonical_kv(tensor: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each `[blocks, block_size, kv_heads, head_dim]`, sharing `tensor`'s memory
    (formats whose tokens or dims are tiled have no such view: `tiled_kv`)."""
    if fmt is BlockFormat.HEAD_MAJOR_AMX:
        raise ValueError("amx blocks are tiled: no [blocks, tokens, heads, dims] view (tiled_kv)")
    if fmt is BlockFormat.KV_FIRST:
        return tensor[0], tensor[1]
    blocks, heads, tokens, width = tensor.shape
    head_dim = width // 2
    if fmt is BlockFormat.TOKEN_INTERLEAVED:
        # [B, H, N, 2, D] -> [B, N, H, D] each
        kv = tensor.unflatten(3, (2, head_dim)).permute(0, 2, 1, 3, 4)
        return kv[:, :, :, 0], kv[:, :, :, 1]
    if tensor.stride(3) != 1 or tensor.stride(2) != width:
        raise ValueError(f"a head-major KV block must be dense per head; strides {tensor.stride()}")
    s_block, s_head = tensor.stride(0), tensor.stride(1)
    shape = (blocks, tokens, heads, head_dim)
    # Per (block, head): K^T [D, N] (token t's K[d] at d * N + t), then V [N, D].
    k = tensor.as_strided(shape, (s_block, 1, s_head, tokens))
    v = tensor.as_strided(
        shape, (s_block, head_dim, s_head, 1), tensor.storage_offset() + tokens * head_dim
    )
    return k, v
