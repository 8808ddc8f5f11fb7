"""Our CPU_ATTN views against vLLM's own kernels: where `cpu_attn_reshape_and_cache` puts
each token's K and V is where `canonical_kv` (kernels vec, vec16) and `tiled_kv` (amx)
read them (vec keeps K transposed per block and head, amx packs K and V in AMX tiles: a
view that took either for rows would scramble any part of a block). The amx kernel runs
only on hosts with AMX; tests/vllm/parts/test_vllm_amx_layout.py checks its layout's
copies everywhere."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from asynchicache.integrations.vllm.layouts.block_layouts import (
    BlockCopier,
    BlockFormat,
    canonical_kv,
    tiled_kv,
)

B, H, N, D = 4, 3, 32, 64  # blocks, kv heads, block size (CPU: a multiple of 32), head dim
P = 16
amx_only = pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="no AMX on this host (lscpu: amx_tile): vLLM's amx kernel cannot run here",
)


def kernel_cache(isa: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A CPU_ATTN layer tensor with `k`, `v` ([tokens, H, D]) written by vLLM's kernel."""
    cache = torch.zeros(B, H, N, 2 * D, dtype=k.dtype)
    key_cache, value_cache = cache.view(B, H, 2 * N, D).chunk(2, dim=2)  # as cpu_attn.py
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    return cache


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_canonical_kv_reads_what_the_cpu_kernel_wrote(isa: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(B * N, H, D, generator=gen), torch.randn(B * N, H, D, generator=gen)
    cache = kernel_cache(isa, k, v, torch.arange(B * N))
    view_k, view_v = canonical_kv(cache, BlockFormat.HEAD_MAJOR_SPLIT)
    torch.testing.assert_close(view_k, k.view(B, N, H, D), rtol=0, atol=0)
    torch.testing.assert_close(view_v, v.view(B, N, H, D), rtol=0, atol=0)


def test_a_page_loaded_into_part_of_a_block_is_what_the_kernel_would_have_written() -> None:
    """Page 1 of block 2 saved, then loaded as the first page of block 0: block 0's first
    16 tokens equal a cache where the kernel wrote those tokens there directly."""
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(N, H, D, generator=gen), torch.randn(N, H, D, generator=gen)
    cache = kernel_cache("vec", k, v, torch.arange(2 * N, 3 * N))  # block 2
    copier = BlockCopier([cache], BlockFormat.HEAD_MAJOR_SPLIT, 1, P)
    pool = torch.zeros(2, *copier.page_shape)
    copier.save([2], pool, [0], first_page=1)  # tokens P .. 2P of block 2
    copier.load(pool, [0], [0])
    want = kernel_cache("vec", k[P:], v[P:], torch.arange(P))  # the kernel, into block 0
    view_k, view_v = canonical_kv(cache, BlockFormat.HEAD_MAJOR_SPLIT)
    want_k, want_v = canonical_kv(want, BlockFormat.HEAD_MAJOR_SPLIT)
    torch.testing.assert_close(view_k[0, :P], want_k[0, :P], rtol=0, atol=0)
    torch.testing.assert_close(view_v[0, :P], want_v[0, :P], rtol=0, atol=0)
    torch.testing.assert_close(
        cache[0].view(-1)[want[0].view(-1) != 0],
        want[0].view(-1)[want[0].view(-1) != 0],
        rtol=0,
        atol=0,
    )


@amx_only
def test_tiled_views_read_what_the_amx_kernel_wrote() -> None:
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(B * N, H, D, generator=gen).bfloat16() for _ in range(2))
    cache = kernel_cache("amx", k, v, torch.arange(B * N))
    view_k, view_v = tiled_kv(cache, BlockFormat.HEAD_MAJOR_AMX)
    torch.testing.assert_close(view_k.logical(), k.view(B, N, H, D), rtol=0, atol=0)
    torch.testing.assert_close(view_v.logical(), v.view(B, N, H, D), rtol=0, atol=0)


@amx_only
def test_a_page_loaded_into_part_of_an_amx_block_is_what_the_kernel_would_have_written() -> None:
    """Page 1 of block 2 saved, then loaded as the first page of block 0: block 0's bytes
    equal those of a cache where the amx kernel wrote those tokens there directly."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(N, H, D, generator=gen).bfloat16() for _ in range(2))
    cache = kernel_cache("amx", k, v, torch.arange(2 * N, 3 * N))  # block 2
    copier = BlockCopier([cache], BlockFormat.HEAD_MAJOR_AMX, 1, P)
    pool = torch.zeros(2, *copier.page_shape, dtype=torch.bfloat16)
    copier.save([2], pool, [0], first_page=1)  # tokens P .. 2P of block 2
    copier.load(pool, [0], [0])
    want = kernel_cache("amx", k[P:], v[P:], torch.arange(P))  # the kernel, into block 0
    torch.testing.assert_close(cache[0], want[0], rtol=0, atol=0)
