"""The vLLM connector's block copies with vLLM's CUDA KV layouts on a GPU (no vLLM import).

vLLM 0.32's CUDA backends (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION) hand the
connector one tensor per layer whose logical shape is `[blocks, kv_heads,
block_size, 2 * head_dim]`, each token's row `[K | V]`; its memory order follows
VLLM_KV_CACHE_LAYOUT (vllm/v1/kv_cache_layout.py): LBNHC (the classic NHD order,
the default), LBHNC (HND), or the cross-layer BLNHC, where a layer's tensor is a
slice of one `[blocks, layers, block_size, kv_heads, 2 * head_dim]` allocation.
Older vLLM's FlashAttention used `[2, blocks, block_size, kv_heads, head_dim]`.
Each is built here with torch on the GPU; pages go to a pinned L2 pool and back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from cuda_marks import ON_CUDA

from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.integrations.vllm.layouts.block_layouts import (
    BlockCopier,
    BlockFormat,
    canonical_kv,
)

pytestmark = ON_CUDA

B, N, H, D, L = 6, 32, 2, 64, 3  # blocks, block size, kv heads, head dim, layers
P = 16  # 2 pages per block
CUDA = torch.device("cuda")
Truth = list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V [B, N, H, D]


def _nhd(truth: Truth) -> list[torch.Tensor]:
    """LBNHC: memory [B, N, H, 2D] per layer, logical [B, H, N, 2D]."""
    return [torch.cat([k, v], dim=-1).permute(0, 2, 1, 3) for k, v in truth]


def _hnd(truth: Truth) -> list[torch.Tensor]:
    """LBHNC: memory and logical [B, H, N, 2D] per layer."""
    return [torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).contiguous() for k, v in truth]


def _cross_layer(truth: Truth) -> list[torch.Tensor]:
    """BLNHC: one [B, L, N, H, 2D] allocation; layer l is a strided slice of it."""
    whole = torch.stack([torch.cat([k, v], dim=-1) for k, v in truth], dim=1)
    return [whole[:, layer].permute(0, 2, 1, 3) for layer in range(len(truth))]


def _kv_first(truth: Truth) -> list[torch.Tensor]:
    """Older FlashAttention: [2, B, N, H, D] per layer."""
    return [torch.stack([k, v]).contiguous() for k, v in truth]


BUILDERS: dict[str, tuple[Callable[[Truth], list[torch.Tensor]], BlockFormat]] = {
    "LBNHC": (_nhd, BlockFormat.TOKEN_INTERLEAVED),
    "LBHNC": (_hnd, BlockFormat.TOKEN_INTERLEAVED),
    "BLNHC": (_cross_layer, BlockFormat.TOKEN_INTERLEAVED),
    "kv-first": (_kv_first, BlockFormat.KV_FIRST),
}


def _truth(seed: int, dtype: torch.dtype) -> Truth:
    gen = torch.Generator(device=CUDA).manual_seed(seed)

    def one() -> torch.Tensor:
        return torch.randn(B, N, H, D, generator=gen, device=CUDA).to(dtype)

    return [(one(), one()) for _ in range(L)]


def _kv(tensor: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """K and V stacked, `[B, 2, N, H, D]` (a copy, for comparisons)."""
    return torch.stack(canonical_kv(tensor, fmt), dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", BUILDERS)
def test_blocks_to_pinned_l2_and_back(name: str, dtype: torch.dtype) -> None:
    build, fmt = BUILDERS[name]
    truth = _truth(0, dtype)
    tensors = build(truth)
    assert all(t.is_cuda for t in tensors)
    copier = BlockCopier(tensors, fmt, ratio=1, page_size=P)
    layout = KVLayout(L, H, D, P, dtype)
    pool = HostPool.create(layout, 16, pin_memory=True, tag="cuda-layouts")
    try:
        l2 = pool.tensor
        assert l2 is not None and pool.pinned
        # whole blocks 4, 1 (gathered on the GPU), block 2's second page alone (a token
        # range), block 5 into scattered slots
        copier.save([4, 1], l2, [7, 2, 0, 9])
        copier.save([2], l2, [11], first_page=1)
        copier.save([5], l2, [15, 3])
        for slot, block, page in ((7, 4, 0), (9, 1, 1), (11, 2, 1), (3, 5, 1)):
            rows = slice(page * P, (page + 1) * P)
            for layer, (k, v) in enumerate(truth):
                assert torch.equal(l2[slot, layer, 0], k[block, rows].cpu())
                assert torch.equal(l2[slot, layer, 1], v[block, rows].cpu())
        for t in tensors:
            t.zero_()
        # blocks 0 and 3 whole, then block 5's first page only (the rest stays zero)
        copier.load(l2, [7, 2, 0, 9, 15], [0, 3, 5])
        for layer, t in enumerate(tensors):
            got, (k, v) = _kv(t, fmt), truth[layer]
            assert torch.equal(got[0, 0], k[4]) and torch.equal(got[3, 1], v[1])
            assert torch.equal(got[5, 0, :P], k[5, :P])
            assert not got[5, :, P:].any() and not got[[1, 2, 4]].any()
    finally:
        pool.close()


def test_a_manager_block_of_two_kernel_blocks_on_the_gpu() -> None:
    truth = _truth(1, torch.bfloat16)
    tensors = _nhd(truth)
    copier = BlockCopier(tensors, BlockFormat.TOKEN_INTERLEAVED, ratio=2, page_size=P)
    l2 = torch.zeros(8, L, 2, P, H, D, dtype=torch.bfloat16).pin_memory()
    copier.save([1], l2, [3, 2, 1, 0])  # kernel blocks 2 and 3
    assert torch.equal(l2[1, 0, 0], truth[0][0][3, :P].cpu())
    copier.load(l2, [3, 2, 1], [0])  # kernel block 0 whole, kernel block 1's first page
    got = _kv(tensors[2], BlockFormat.TOKEN_INTERLEAVED)
    assert torch.equal(got[0, 1], truth[2][1][2])
    assert torch.equal(got[1, 0, :P], truth[2][0][3, :P])
